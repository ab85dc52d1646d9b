"""The compiled-program runtime shared by the backends and the sampling engine (design.md's `runtime`
layer). So far: JAX's persistent compilation cache for a tx process, so a restarted server does not
compile again.

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

import logging
import os
import threading
from pathlib import Path

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
