"""Merge a LoRA adapter into its base model and write an HF safetensors directory transformers can load
(`python -m tx.export` is its command line).

`adapter` is a tx sampler checkpoint (tar.gz, local or cloud) or a PEFT adapter directory. Each adapted weight
becomes `W + (alpha / r) * B @ A` (per expert for MoE), computed in float32 and stored in the checkpoint's dtype.
The base checkpoint is processed one safetensors shard at a time, keeping its file layout and index; config,
generation config and tokenizer files are copied.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from tx.checkpoints import peft_format, storage
from tx.checkpoints.hf_files import copy_files
from tx.models.config import ModelConfig
from tx.models.loading import resolve_model_dir
from tx.models.safetensors_io import SafetensorsDir, save_file


def _deltas(adapter_dir: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF weight name -> float32 delta [out, in] to add."""
    weights, rank, alpha = peft_format.import_adapter(SimpleNamespace(config=cfg), adapter_dir, max_rank=1 << 30)
    scale = alpha / rank
    out = {}
    for module, (a, b) in weights.items():
        if ".mlp.experts." in module:
            layer, proj = module.rsplit(".mlp.experts.", 1)
            for e in range(a.shape[0]):
                out[f"{layer}.mlp.experts.{e}.{proj}.weight"] = scale * (b[e] @ a[e])
        else:
            out[f"{module}.weight"] = scale * (b @ a)
    return out


def merge(base_model: str, adapter: str, out_dir: Path) -> int:
    """Write the merged model; return the number of weights changed."""
    base_dir = resolve_model_dir(base_model)
    cfg = ModelConfig.from_dir(base_dir)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = Path(adapter)
        if not adapter_dir.is_dir():
            with storage.read_file(adapter) as tar:
                storage.unpack_tar(tar, Path(tmp))
            adapter_dir = Path(tmp)
        deltas = _deltas(adapter_dir, cfg)
    files = SafetensorsDir(base_dir)
    if "lm_head.weight" in deltas and "lm_head.weight" not in files:
        raise ValueError("the adapter trains the LM head of a model with tied embeddings; merging it would also "
                         "change the input embeddings, so it cannot be exported as a plain HF checkpoint")
    missing = sorted(set(deltas) - set(files.keys()))
    if missing:
        raise ValueError(f"adapter weights have no base tensor: {missing[:3]} (per-expert base tensors are required)")
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = 0
    for shard in tqdm(sorted(base_dir.glob("*.safetensors")), desc="merging", unit="shard", disable=None):
        shard_files = SafetensorsDir.single(shard)
        tensors = {}
        for name in shard_files.keys():
            tensor = shard_files.get(name)
            if name in deltas:
                tensor = (tensor.astype(np.float32) + deltas[name]).astype(tensor.dtype)
                changed += 1
            tensors[name] = np.asarray(tensor)
        save_file(tensors, out_dir / shard.name)
    copy_files(base_dir, out_dir)
    return changed
