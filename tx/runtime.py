"""The compiled-program runtime shared by the backends and the sampling engine (design.md's `runtime`
layer): `Runtime` (each program built once per key, counted when traced and when called, run eagerly under
`enforce_eager`, inputs placed on the mesh), `ProgramLog`, the shape buckets that keep programs few, and
JAX's persistent compilation cache for a tx process, so a restarted server does not compile again.

Every compiled program (each forward_backward shape bucket, each sampling program) is written to disk
after its first compile and read back by any later process that compiles the same program. JAX keys an
entry by the program's HLO (shapes, shardings, the mesh's device assignment), the compile options, the
XLA flags, the platform and the jax/jaxlib versions, so a different mesh, model or jax version never reads
a wrong entry; the folder is also split by jax version and platform (`jax-0.10.2-cpu`), so an upgrade
leaves the old entries in a folder of their own to delete. Writes and reads are serialised by a file lock
and the folder is kept under `MAX_BYTES` (least recently used entries go first), so processes may share
it.

Counters: `compile_cache_stats()` (hits, misses: JAX's own monitoring events), reported by the backend's
metrics.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tx import types

logger = logging.getLogger(__name__)

MAX_BYTES = 16 * 2**30  # LRU eviction beyond this (and the file lock that eviction brings)
MIN_COMPILE_S = 0.2  # programs that compile faster are not worth a disk round trip

_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_stats = {"hits": 0, "misses": 0}
_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        with _lock:
            _stats[name] += 1


def compile_cache_stats() -> dict[str, int]:
    """Persistent-cache hits and misses of this process so far (programs read from / not found on disk)."""
    with _lock:
        return dict(_stats)


def enable_compile_cache(root: str | Path) -> Path:
    """Use `root/jax-<version>-<platform>` as JAX's persistent compilation cache; the folder used. Call
    before the first compile (after `jax.distributed.initialize`, which the platform needs)."""
    global _listening
    import jax

    folder = Path(root).expanduser().resolve() / f"jax-{jax.__version__}-{jax.default_backend()}"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # a user's own setting wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    entries = sum(1 for p in folder.iterdir() if p.name.endswith("-cache"))
    logger.info("compilation cache: %s (%d programs on disk; kept under %d GiB)", folder, entries, MAX_BYTES >> 30)
    return folder


# ---- shape buckets: few distinct shapes, so few programs ----

def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def bucket_length(n: int, minimum: int = 16) -> int:
    """Round up to the next of 16, 24, 32, 48, 64, 96, ... (two significant bits): <= 50% padding,
    and only a logarithmic number of distinct shapes to compile."""
    if n <= minimum:
        return minimum
    top = pow2(n)
    return top * 3 // 4 if n <= top * 3 // 4 else top


def bucket_rows(n: int, multiple: int) -> int:
    """Rows padded to a power of two times `multiple` (the fsdp size)."""
    return multiple * (1 << max(0, math.ceil(math.log2(max(1, math.ceil(n / multiple))))))


# ---- programs ----

def _abstract(x: Any) -> Any:
    """An array's shape, dtype and sharding (what lowering needs); anything else as it is."""
    import jax

    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def release_freed_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`); False where the C library has
    none. A compile (XLA, LLVM) frees hundreds of MB in pieces the allocator keeps: a CPU process that
    compiled the RL sampling workload's 10 decode programs held ~0.4 GB more resident memory for the rest of
    its life (docs/performance.md), which the large buffers of later calls (separately mapped) never reuse."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


_MADV_DONTNEED = 4  # Linux: a private anonymous page read after it is zero-filled again


def release_zero_pages(array: Any) -> int:
    """Hand back to the system the memory pages of `array`'s CPU shards, which must hold only zeros (the
    caller's promise): they stay mapped and read as zeros, and become resident again only where written. A
    paged engine's KV pool is sized for every slot at full length and zero-filled when made; after this it
    costs the pages its rows wrote (pages are handed out lowest first). Returns the bytes released: 0 off Linux
    (elsewhere this advice need not zero a page) and for device memory, which is no process page."""
    import sys

    madvise = getattr(_libc(), "madvise", None)
    if sys.platform != "linux" or madvise is None:
        return 0
    import ctypes

    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    page, released = os.sysconf("SC_PAGE_SIZE"), 0
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        shard.data.block_until_ready()  # nothing may still be writing it
        start = shard.data.unsafe_buffer_pointer()
        first, end = -(-start // page) * page, (start + shard.data.nbytes) // page * page  # whole pages inside
        if end > first and madvise(first, end - first, _MADV_DONTNEED) == 0:
            released += end - first
    return released


@functools.cache
def _libc() -> Any:
    """The process's C library, or None where ctypes cannot open it (Windows)."""
    import ctypes

    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


class ProgramLog:
    """The last call of each compiled program, kept so that tests and tools can lower the real programs:
    per program name, the jitted function and its arguments reduced to shape, dtype and sharding (no device
    buffers are kept); `lowered(name)` lowers it again for those arguments. Off by default: recording costs a
    tree walk per call."""

    def __init__(self) -> None:
        self.enabled = False
        self._calls: dict[str, tuple[Callable, Any, dict]] = {}

    def record(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> None:
        if self.enabled:
            import jax

            self._calls[name] = (fn, jax.tree.map(_abstract, args), kwargs)

    def lowered(self, name: str) -> Any:
        """The program `name` ("forward_backward", "optim_step", "sample_decode", ...) lowered for the
        arguments of its last recorded call (a `jax.stages.Lowered`)."""
        if name not in self._calls:
            raise KeyError(f"no recorded call of program {name!r} (set programs.enabled = True before calling it); "
                           f"recorded: {', '.join(sorted(self._calls)) or 'none'}")
        fn, args, kwargs = self._calls[name]
        return fn.lower(*args, **kwargs)


class Runtime:
    """The compiled programs of one model on one mesh, for whoever runs them (a backend's passes and
    optimizer steps, the sampling engine's calls). Each program is built once per key (its name first, then
    whatever decides its shapes), counted in `metrics.compiles` each time it is traced and in
    `metrics.calls` each time it runs, and run with jit disabled under `enforce_eager`."""

    def __init__(self, mesh: Any, metrics: types.EngineMetrics, enforce_eager: bool = False):
        self.mesh, self.metrics, self.enforce_eager = mesh, metrics, enforce_eager
        self.programs = ProgramLog()  # each program's last call, once enabled: tests lower the real programs
        self._built: dict[Any, Callable] = {}

    def counted(self, name: str) -> Callable[[], None]:
        """A callback counting one compile of program `name` (call it while tracing)."""
        def on_trace():
            self.metrics.compiles[name] = self.metrics.compiles.get(name, 0) + 1

        return on_trace

    def program(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        """The program of `key`, built by `build()` the first time."""
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def keys(self) -> list[tuple]:
        """The keys of the programs built so far (what decided each one's shapes)."""
        return list(self._built)

    def jit(self, key: tuple, fn: Callable, static: tuple[str, ...] = (), donate: tuple[str, ...] = ()) -> Callable:
        """`program(key)` as `jax.jit(fn)` counting its traces under the name `key[0]`."""
        import jax

        on_trace = self.counted(key[0])

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            on_trace()
            return fn(*args, **kwargs)

        return self.program(key, lambda: jax.jit(traced, static_argnames=static, donate_argnames=donate))

    def run(self, name: str, fn: Callable, *args, **kwargs) -> Any:
        """Call program `fn` (counted under `name`; recorded when `programs.enabled`). A call that compiled
        returns the heap its compile freed to the system (`release_freed_heap`)."""
        import jax

        self.metrics.calls[name] = self.metrics.calls.get(name, 0) + 1
        self.programs.record(name, fn, args, kwargs)
        compiles = self.metrics.compiles.get(name, 0)
        with jax.disable_jit() if self.enforce_eager else contextlib.nullcontext():
            out = fn(*args, **kwargs)
        if self.metrics.compiles.get(name, 0) != compiles:
            release_freed_heap()
        return out

    def count_tokens(self, name: str, real: int, padded: int) -> None:
        """Tokens of the datums and of the padded device batch of one call of `name` (the padding overhead)."""
        for counter, n in ((self.metrics.tokens_real, real), (self.metrics.tokens_padded, padded)):
            counter[name] = counter.get(name, 0) + n

    def put_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Host arrays onto the mesh, rows split over the fsdp devices (`models.sharding.batch_spec`)."""
        from jax.sharding import NamedSharding

        from tx.models.sharding import batch_spec, put_global

        return {k: put_global(v, NamedSharding(self.mesh, batch_spec(v.ndim))) for k, v in arrays.items()}
