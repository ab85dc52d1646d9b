"""Host-local views checked before a call runs, and the workers' fault-injection hook for tests.

A call that reads files on every host (a training checkpoint, a sampler checkpoint) can fail on one host
only: a mount missing there, a permission, an I/O error. Failing inside the call would leave the other
hosts blocked in its collectives, so before `go` every host reads those files and reports a view
{path: None if readable, else the error}; process 0 runs the call only if all views are equal. When they
are equal but show an error, every host raises the same error before changing state, which is an
ordinary failed request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from tx.checkpoints import storage

FAULT_ENV = "TX_DEBUG_FAIL_CALL"  # tests: comma-separated methods a worker fails while executing


def _read_all(root: Path) -> None:
    """Read every byte under `root` (a file or a directory) so that unreadable files raise here."""
    if root.is_file():
        files = [root]
    else:
        files = []

        def fail(e: OSError):
            raise e

        for here, _, names in os.walk(root, onerror=fail):
            files += [Path(here) / n for n in names]
    for f in sorted(files):
        with open(f, "rb") as fh:
            while fh.read(1 << 22):
                pass


def _status(fn: Callable[[], None]) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the view; hosts compare it
        return f"{type(e).__name__}: {e}"
    return None


def _training_checkpoint(backend, path) -> None:
    backend.checkpoint_metadata(path)  # the format this backend loads (LoRA or full training state)
    with storage.read_dir(path) as local:
        _read_all(local)


def _sampler_checkpoint(path) -> None:
    with storage.read_file(path) as local:
        _read_all(local)


def _load_checkpoint_view(backend, kwargs: dict) -> dict:
    path = str(kwargs["checkpoint_path"])
    return {path: _status(lambda: _training_checkpoint(backend, path))}


def _sample_view(backend, kwargs: dict) -> dict:
    """Sampler checkpoints this call will read from disk (not those held in a slot or in memory; full
    training samples only its live weights and never reads one)."""
    if backend.training_mode == "full":
        return {}
    paths = {p for p in kwargs["prepared_batch"].all_checkpoint_paths if p}
    return {p: _status(lambda p=p: _sampler_checkpoint(p)) for p in sorted(paths)
            if p not in backend.slots.sampler and not backend.holds_snapshot(p)}


VIEWS: dict[str, Callable[[Any, dict], dict]] = {
    "load_checkpoint": _load_checkpoint_view,
    "sample": _sample_view,
    "sample_submit": _sample_view,
}


def view(method: str, backend, kwargs: dict) -> dict | None:
    fn = VIEWS.get(method)
    return None if fn is None or backend is None else fn(backend, kwargs)


def injected_failure(method: str, process_id: int) -> None:
    """Raise if the test environment asks this worker to fail `method` (a one-sided failure inside a call)."""
    methods = [m for m in os.environ.get(FAULT_ENV, "").split(",") if m]
    if method in methods:
        raise RuntimeError(f"injected failure of {method} on process {process_id} ({FAULT_ENV}={','.join(methods)})")
