"""Training data rows and their order, for every trainer.

Sources: local JSON-lines files natively; Parquet, Arrow, CSV and Hugging Face dataset names through the
`datasets` package when it is installed. Each epoch visits the rows in a seeded permutation, so step N always sees
the same rows and resuming is exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

_SPLIT = re.compile(r"^([\w.-]*)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?$")


def split_slice(split: str) -> tuple[str, str]:
    """`name[start:end]` (HF split syntax, ints or percents) -> (name, "[start:end]" or "")."""
    m = _SPLIT.match(split)
    if m is None:
        raise ValueError(f"data.split: {split!r} is not a split name optionally followed by [start:end]")
    return m.group(1), split[len(m.group(1)):]


def _apply_slice(rows: list, bracket: str) -> list:
    if not bracket:
        return rows

    def bound(text: str | None) -> int | None:
        if not text:
            return None
        return round(len(rows) * int(text[:-1]) / 100) if text.endswith("%") else int(text)

    start, _, end = bracket[1:-1].partition(":")
    return rows[bound(start):bound(end)]


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    """A local file has one split: its name is ignored, a slice (`train[:100]`, `x[10%:]`) is applied."""
    path = Path(source)
    looks_local = path.suffix in (".jsonl", ".json", ".parquet", ".arrow", ".csv") or source.startswith(("/", "."))
    if looks_local and not path.exists():
        raise FileNotFoundError(f"data.dataset: {source} does not exist")
    if path.suffix in (".jsonl", ".json") and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"data.dataset: {source} has no rows")
        return _apply_slice(rows, split_slice(split)[1])
    try:
        import datasets
    except ImportError:
        if path.exists():
            raise ValueError(f"data.dataset: {source} needs the `datasets` package (pip install datasets) "
                             "unless it is a .jsonl file") from None
        raise FileNotFoundError(f"data.dataset: {source} does not exist") from None
    if path.exists():
        kind = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"data.dataset: unsupported file type {path.suffix!r} for {source}")
        return list(datasets.load_dataset(kind, data_files=str(path), split="train" + split_slice(split)[1]))
    return list(datasets.load_dataset(source, split=split))


def batch_indices(seed: int, step: int, num_rows: int, batch_size: int, steps_per_epoch: int) -> np.ndarray:
    """The row indices of 0-based step `step`: slice `step % steps_per_epoch` of epoch `step // steps_per_epoch`'s
    permutation (seeded by (seed, epoch)); a last partial slice is as short as the rows leave."""
    epoch, within = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return order[within * batch_size:(within + 1) * batch_size]
