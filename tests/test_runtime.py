"""JAX's persistent compilation cache as `python -m tx.run` wires it (tx/runtime.py): a second process with the
same cache folder reads the programs the first one compiled instead of compiling them; `--precompile` as
wired there: the smoke job's own calls compile nothing more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import one_device_env
from tx.backends.batching import model_pass_shapes
from tx.sampling.call_shapes import slot_counts

ROOT = Path(__file__).parents[1]


def _smoke(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    env = one_device_env() | {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tx.run", "--job", "smoke", "--steps", "1", *flags], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[-1], proc.stderr


# a small grid: 4 forward_backward shapes (the smoke job's 8 x 32 tokens run as 8 micro-batches of 1 x 32), 2 slot
# counts
PRECOMPILE = ("--precompile", "--max-seq-len", "32", "--train-micro-batch-tokens", "32", "--max-num-seqs", "2")


def test_second_process_reads_the_programs_of_the_first(tmp_path):
    cache = tmp_path / "cache"
    first, log = _smoke(tmp_path, "--compile-cache", str(cache), *PRECOMPILE)
    assert "precompiled" in log
    # grads + accumulate per shape, with and without the LM head's LoRA delta
    assert first["compiles"]["forward_backward"] == 2 * 2 * len(model_pass_shapes(32, 32, 0, 1))
    assert first["compiles"]["sample_decode"] == len(slot_counts(2, 1))
    folders = list(cache.iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("jax-") and folders[0].name.endswith("-cpu"), folders
    written = [p for p in folders[0].iterdir() if p.name.endswith("-cache")]
    assert first["compile_cache"]["hits"] == 0 and first["compile_cache"]["misses"] >= len(written) > 0, first
    assert f"compilation cache: {folders[0]} (0 programs on disk" in log
    second, log = _smoke(tmp_path, "--compile-cache", str(cache), *PRECOMPILE)
    assert f"({len(written)} programs on disk" in log
    assert second["compile_cache"] == {"hits": len(written), "misses": 0}, second
    assert second["compiles"] == first["compiles"]  # traced as before; XLA's compile is what the cache skips



def _rss_bytes() -> int:
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_freed_heap_returns_free_heap_pages_to_the_system():
    """Freed heap chunks below a live one stay resident until trimmed (glibc); `release_freed_heap` hands them
    back: ~190 MB of freed 64 KB chunks leave the resident set."""
    from tx.runtime import release_freed_heap

    assert release_freed_heap()  # glibc on the Linux this runs on
    chunks = [bytearray(b"x" * 65536) for _ in range(3000)]  # touched, below the mmap threshold: heap
    keep = chunks[-1]  # the heap's top stays in use, so free() alone returns nothing
    del chunks
    before = _rss_bytes()
    assert release_freed_heap()
    assert before - _rss_bytes() > 100 * 2**20, (before, _rss_bytes())
    assert keep[0] == ord("x")


def test_a_call_that_compiles_releases_the_freed_heap(monkeypatch):
    """`Runtime.run` trims the heap after a call that compiled its program, not after the calls that reuse it."""
    import jax.numpy as jnp

    import tx.runtime
    from tx import types

    released = []
    monkeypatch.setattr(tx.runtime, "release_freed_heap", lambda: released.append(1) or True)
    runtime = tx.runtime.Runtime(None, types.EngineMetrics())
    program = runtime.jit(("double", 3), lambda x: 2 * x)
    for _ in range(3):
        assert float(runtime.run("double", program, jnp.float32(2.0))) == 4.0
    assert released == [1] and runtime.metrics.compiles == {"double": 1}


def test_release_zero_pages_hands_back_a_zero_array_that_still_reads_zeros_and_takes_writes():
    """A zero-filled CPU array's pages leave the resident set; it still reads zeros, and a donated in-place
    write makes only the written pages resident again."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests.helpers import resident_bytes
    from tx.runtime import release_zero_pages

    pool = jax.device_put(np.zeros((64, 1024, 1024), np.float32)).block_until_ready()  # 256 MB: the copy fills it
    assert resident_bytes(pool) > 250 * 2**20
    before = _rss_bytes()
    assert release_zero_pages(pool) > 250 * 2**20
    assert before - _rss_bytes() > 200 * 2**20 and resident_bytes(pool) == 0
    write = jax.jit(lambda p, v: p.at[3].set(v), donate_argnums=0)
    pool = write(pool, np.full((1024, 1024), 2.0, np.float32)).block_until_ready()
    assert 4 * 2**20 <= resident_bytes(pool) <= 4 * 2**20 + 8192  # the written 4 MB
    got = np.asarray(pool[2:5, :2, :2])
    assert (got[1] == 2.0).all() and not got[0].any() and not got[2].any()
    before = _rss_bytes()
    assert float(jax.jit(lambda p: jnp.abs(p).sum())(pool)) == 2.0 * 2**20  # read whole: zeros but the write
    assert _rss_bytes() - before < 16 * 2**20  # and not resident again (the zero pages read are the system's one)
