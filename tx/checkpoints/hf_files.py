"""The files of a Hugging Face model directory besides its config and weights, and copying them along."""

from __future__ import annotations

import shutil
from pathlib import Path

# Files of a model directory besides config and weights: generation defaults and the tokenizer.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json", "vocab.json", "merges.txt")
COPIED = ("config.json", *SIDE_FILES, "model.safetensors.index.json")


def copy_files(base_dir: Path, out_dir: Path, names: tuple[str, ...] = COPIED) -> None:
    """Copy those of `names` that `base_dir` has into `out_dir`."""
    for name in names:
        if (base_dir / name).exists():
            shutil.copyfile(base_dir / name, out_dir / name)
