"""Merge a LoRA adapter into its base model and write an HF safetensors directory transformers can load.

    python -m tx.export --base-model Qwen/Qwen3-0.6B --adapter run/sampler.tar.gz --out merged/

`--adapter` is a tx sampler checkpoint (tar.gz, local or cloud) or a PEFT adapter directory. Each
adapted weight becomes `W + (alpha / r) * B @ A` (per expert for MoE), computed in float32 and stored in
the checkpoint's dtype. The base checkpoint is processed one safetensors shard at a time, keeping its
file layout and index; config, generation config and tokenizer files are copied.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tx.checkpoints.merge import merge

__all__ = ["main", "merge"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tx.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", required=True, help="HF model directory or hub id the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="tx sampler checkpoint (.tar.gz, local or cloud) or PEFT dir")
    parser.add_argument("--out", required=True, type=Path, help="output directory (HF format)")
    args = parser.parse_args(argv)
    changed = merge(args.base_model, args.adapter, args.out)
    print(json.dumps({"wrote": str(args.out), "merged_weights": changed}))


if __name__ == "__main__":
    main()
