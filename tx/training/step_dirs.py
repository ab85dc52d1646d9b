"""A trainer's step directories: `<root>/global_step_N/` (SkyRL's layout), the file naming the latest complete
one, rotation, and which one a resume reads.

A checkpoint is complete once `commit` has written its trainer state and then the LATEST file: a crash before
that leaves the previous checkpoint the latest one. Exports use the same `global_step_N` names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest_ckpt_global_step.txt"
STATE = "trainer_state.json"
PREFIX = "global_step_"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step}"


def commit(root: str | Path, step: int, state: dict[str, Any], keep: int = 0) -> Path:
    """Write step `step`'s trainer state, then LATEST (last: a crash before it leaves the previous one current),
    then delete all but the `keep` newest step directories (`keep` <= 0: keep all). Returns the step directory."""
    root = Path(root)
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STATE).write_text(json.dumps(state))
    (root / LATEST).write_text(str(step))
    if keep > 0:
        steps = sorted(int(p.name[len(PREFIX):]) for p in root.glob(f"{PREFIX}*"))
        for old in steps[:-keep]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return directory


def latest(root: str | Path) -> Path | None:
    """The step directory LATEST names under `root`; None when nothing was saved yet."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    return Path(root) / f"{PREFIX}{marker.read_text().strip()}"


def resume_dir(root: str | Path | None, target: str | Path | None) -> Path | None:
    """The step directory a resume reads: `target` 'latest' -> `latest(root)` (None: start fresh), '' or None ->
    None (start fresh), else `target` itself."""
    if not target:
        return None
    if target == "latest":
        return latest(root) if root is not None else None
    return Path(target)


def read_state(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / STATE).read_text())
