"""SFT data: load rows, turn them into weighted token sequences, pack them into rows.

Formats: chat rows (`messages_key`, optional `tools_key` and `system_key`) and Alpaca rows
(`instruction`, optional `input`, `output`). Sources: local JSON-lines files natively; Parquet, Arrow and
Hugging Face dataset names through the `datasets` package when it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tx.sft.config import DataConfig
from tx.sft.masks import Example, tokenize_conversation


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    path = Path(source)
    if path.suffix in (".jsonl", ".json") and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"data.dataset: {source} has no rows")
        return rows
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
        return list(datasets.load_dataset(kind, data_files=str(path), split=split))
    return list(datasets.load_dataset(source, split=split))


def to_messages(row: dict[str, Any], cfg: DataConfig) -> tuple[list[dict], list[dict] | None]:
    if cfg.messages_key in row:
        messages = list(row[cfg.messages_key])
    elif "instruction" in row and "output" in row:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    else:
        raise ValueError(f"data: row has neither {cfg.messages_key!r} nor instruction/output columns: {sorted(row)}")
    if cfg.system_key and row.get(cfg.system_key):
        messages = [{"role": "system", "content": row[cfg.system_key]}] + messages
    return messages, row.get(cfg.tools_key) or None


def tokenize_rows(rows: list[dict], tokenizer, cfg: DataConfig) -> list[Example]:
    examples = []
    for row in rows:
        messages, tools = to_messages(row, cfg)
        ex = tokenize_conversation(tokenizer, messages, cfg.train_on_what, tools=tools, max_length=cfg.max_length)
        if ex is not None:
            examples.append(ex)
    if not examples:
        raise ValueError(f"data: no example of {cfg.dataset} has trainable tokens after truncation to "
                         f"max_length={cfg.max_length}")
    return examples


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: groups of example indices whose total length fits `capacity`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def packed_rows(examples: list[Example], capacity: int | None) -> list[dict[str, np.ndarray]]:
    """Datums for the backend: each packed row concatenates its examples, with segment ids."""
    groups = pack([len(e.input_ids) for e in examples], capacity) if capacity else [[i] for i in range(len(examples))]
    rows = []
    for group in groups:
        parts = [examples[i] for i in group]
        rows.append({
            "input_ids": np.concatenate([p.input_ids for p in parts]),
            "targets": np.concatenate([p.target_tokens for p in parts]),
            "weights": np.concatenate([p.weights for p in parts]),
            "segment_ids": np.concatenate([np.full(len(p.input_ids), s, np.int32) for s, p in enumerate(parts)]),
            "examples": group,
        })
    return rows
