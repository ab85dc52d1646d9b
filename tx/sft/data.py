"""SFT data: turn rows into weighted token sequences, pack them into rows.

Formats: chat rows (`messages_key`, optional `tools_key` and `system_key`) and Alpaca rows
(`instruction`, optional `input`, `output`). Rows come from `tx.training.data.load_rows` (JSON lines natively;
Parquet, Arrow and Hugging Face dataset names through the `datasets` package when it is installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tx.sft.config import DataConfig
from tx.sft.masks import Example, tokenize_conversation
from tx.training.data import load_rows  # also tx.sft.data.load_rows, as before


def to_messages(row: dict[str, Any], cfg: DataConfig) -> tuple[list[dict], list[dict] | None]:
    if cfg.messages_key in row:
        messages = list(row[cfg.messages_key])
    elif "instruction" in row and "output" in row:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    else:
        raise ValueError(f"data: row has neither {cfg.messages_key!r} nor instruction/output columns: {sorted(row)}")
    if cfg.system_key and row.get(cfg.system_key) and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": row[cfg.system_key]}] + messages
    tools = row.get(cfg.tools_key) or None
    if isinstance(tools, str):  # tool schemas stored as a JSON string (a common dataset layout)
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"data: column {cfg.tools_key!r} is a string but not JSON: {e}") from None
    return messages, tools


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


def cache_key(source: str, split: str, cfg: DataConfig, tokenizer) -> str:
    """Changes with the data file (path, size, mtime), the data config and the tokenizer's vocabulary."""
    import hashlib

    path = Path(source)
    stat = f"{path.stat().st_size}-{path.stat().st_mtime_ns}" if path.exists() else ""
    parts = [str(path.resolve()) if path.exists() else source, split, stat, cfg.model_dump_json(),
             str(len(tokenizer)), tokenizer.chat_template or "", tokenizer.name_or_path]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def load_examples(source: str, split: str, tokenizer, cfg: DataConfig, cache_dir: str | None = None,
                  force_recache: bool = False) -> tuple[list[Example], bool]:
    """Tokenized examples, from `cache_dir` when a matching cache exists; returns (examples, cache_hit)."""
    cache = Path(cache_dir) / f"{cache_key(source, split, cfg, tokenizer)}.npz" if cache_dir else None
    if cache is not None and cache.exists() and not force_recache:
        with np.load(cache) as z:
            bounds = z["bounds"]
            return [Example(z["input_ids"][a:b], z["target_tokens"][a:b], z["weights"][a:b])
                    for a, b in zip(bounds[:-1], bounds[1:])], True
    examples = tokenize_rows(load_rows(source, split), tokenizer, cfg)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, bounds=np.cumsum([0] + [len(e.input_ids) for e in examples]),
                 input_ids=np.concatenate([e.input_ids for e in examples]),
                 target_tokens=np.concatenate([e.target_tokens for e in examples]),
                 weights=np.concatenate([e.weights for e in examples]))
        tmp.replace(cache)
    return examples, False


def dummy_examples(count: int, length: int, vocab: int, seed: int = 0) -> list[Example]:
    """Full-length random examples, every token trained: the largest activations the config allows."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, length + 1).astype(np.int32)
        out.append(Example(ids[:-1], ids[1:], np.ones(length, np.float32)))
    return out
