"""`python -m tx.sft --config sft.yaml [key=value ...]`: supervised fine-tuning of one or more LoRA runs.

Two config formats, told apart by their keys (or forced with --format):
- tx's own SFTConfig (tx/sft/config.py): `base_model`, `runs: [{name, rank, learning_rate, ...}]`,
  `optimizer: {beta1, beta2, scheduler, warmup_steps, ...}`, `data: {dataset, max_length, ...}`, ...;
  several runs (a sweep) train concurrently in shared batches.
- SkyRL's SFTConfig names (tx/sft/seed_config.py), so a SkyRL SFT config runs unchanged: `model.path`,
  `model.lora.{rank,alpha,target_modules}`, `optimizer_config.{lr,adam_betas,weight_decay,max_grad_norm,
  num_warmup_steps,scheduler}`, `dataset_name`, `dataset_split`, `max_length`, `batch_size`,
  `micro_train_batch_size_per_gpu`, `use_sequence_packing`, `ckpt_path`, `resume_from`, `export_path`, ...
  with SkyRL's defaults (one run, named "policy"); `model.lora.rank: 0` (SkyRL's default) is full training.
  Ray/Megatron/FSDP placement fields (placement.*, megatron_config.*, fsdp_config.*, strategy, ...) are
  ignored with a warning naming each; tx-only settings go under `tx:` (native names).
A config is SkyRL-format when a top-level key exists only there (model, optimizer_config, dataset_name,
...), tx-format otherwise; keys of both in one config are an error.

Overrides use dotted keys, values parsed as YAML: `batch_size=16`, `data.max_length=512`,
`optimizer.scheduler=cosine`, `runs=[{name: a, learning_rate: 1e-4}]` (tx format);
`model.lora.rank=32`, `optimizer_config.lr=1e-4` (SkyRL format).
Prints one JSON line per step / eval and a final summary; errors name the offending field.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Literal

from pydantic import ValidationError

from tx.sft.config import SFTConfig
from tx.sft.seed_config import SeedFieldIgnored, detect_format, from_seed
from tx.training.overrides import load_values
from tx.training.progress import add_progress_flag


def load_config(path: str | None, overrides: list[str], fmt: Literal["auto", "tx", "seed"] = "auto") -> SFTConfig:
    values, top = load_values(path, overrides)
    if fmt == "auto":
        fmt = detect_format(values)
    return from_seed(values, top) if fmt == "seed" else SFTConfig.model_validate(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tx.sft", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file: tx SFTConfig fields or SkyRL SFTConfig fields")
    parser.add_argument("--format", choices=["auto", "tx", "seed"], default="auto",
                        help="config format: 'seed' = SkyRL's SFTConfig names, 'tx' = tx's own; "
                             "'auto' (default) tells them apart by their keys")
    add_progress_flag(parser)
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        with warnings.catch_warnings(record=True) as ignored:
            warnings.simplefilter("always", SeedFieldIgnored)
            cfg = load_config(args.config, args.overrides, args.format)
    except (ValidationError, ValueError) as e:
        print(f"invalid SFT config:\n{e}", file=sys.stderr)
        return 2
    for w in ignored:  # one line per SkyRL field tx does not use
        print(f"warning: {w.message}", file=sys.stderr)
    from tx.sft.trainer import SFTTrainer

    try:
        trainer = SFTTrainer(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"invalid SFT setup: {e}", file=sys.stderr)
        return 2
    trainer.metrics.stdout = True  # metrics to stdout as JSON lines too
    trainer.progress = args.progress
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
