"""`python -m tx.sft --config sft.yaml [key=value ...]`: supervised fine-tuning of one or more LoRA runs.

Overrides use dotted keys into SFTConfig, values parsed as YAML: `batch_size=16`,
`data.max_length=512`, `optimizer.scheduler=cosine`, `runs=[{name: a, learning_rate: 1e-4}]`.
Prints one JSON line per step / eval and a final summary; errors name the offending field.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from tx.sft.config import SFTConfig


def load_config(path: str | None, overrides: list[str]) -> SFTConfig:
    values = yaml.safe_load(Path(path).read_text()) if path else {}
    values = values or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} must look like key=value")
        node = values
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return SFTConfig.model_validate(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tx.sft", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", help="YAML file with SFTConfig fields")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValidationError as e:
        print(f"invalid SFT config:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from tx.sft.trainer import SFTTrainer

    try:
        trainer = SFTTrainer(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"invalid SFT setup: {e}", file=sys.stderr)
        return 2
    trainer.log = lambda record: print(json.dumps(record), flush=True)  # metrics to stdout as JSON lines
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
