"""A trainer's config values from a YAML file and `key=value` command-line overrides (dotted keys, values parsed
as YAML), before the trainer's config model validates them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def apply_overrides(values: dict, overrides: list[str]) -> set[str]:
    """Set each dotted `key=value` in `values`; returns the top-level keys overridden."""
    top = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value")
        if key.startswith("+"):
            raise ValueError(f"override {item!r}: the '+' prefix is not supported (every field already exists)")
        node = values
        *parents, leaf = key.split(".")
        for depth, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {'.'.join(parents[:depth + 1])} is not a section")
        node[leaf] = yaml.safe_load(raw)
        top.add(key.split(".")[0])
    return top


def load_values(path: str | None, overrides: list[str]) -> tuple[dict[str, Any], set[str]]:
    """The mapping in YAML file `path` (none: empty) with `overrides` applied, and the top-level keys overridden."""
    values = yaml.safe_load(Path(path).read_text()) if path else {}
    values = values or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config fields, got {type(values).__name__}")
    return values, apply_overrides(values, overrides)


def deep_merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in: nested mappings merge key by key, anything else in `extra` replaces."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
