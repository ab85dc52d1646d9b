"""Checkpoints of full-parameter training: the whole training state with orbax, and the trained model as an
HF safetensors directory (for transformers, tx's own loader, and sampler checkpoints).

Training state (`save_full_checkpoint` / `load_full_checkpoint`): every weight and optimizer leaf is
written by orbax from the device arrays, each host its own shards, into a versioned directory whose LATEST
pointer moves last (`storage.write_dir`): a crash mid-save leaves the previous version current. A restore
reads onto whatever shardings the caller's targets carry, so another mesh, device or process count works.

HF export (`export_hf_model`) is the inverse of `tx.models.loading`: kernels `[in, out]` become HF's
`[out, in]`, stacked layers and experts become per-layer and per-expert tensors. That is the released
Qwen3-MoE layout, which transformers 5 also writes (`save_pretrained` splits its fused in-memory experts
back) and vLLM reads. Tensors are gathered from the devices a block of at most `chunk_bytes` at a time and
streamed into the files, so host memory never holds a copy of the model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx import ranks
from tx.version import __version__
from tx.checkpoints import storage
from tx.checkpoints.training import (CheckpointError, _flatten, base_signature, read_metadata,
                                     standard_checkpointer)
from tx.checkpoints.hf_files import SIDE_FILES, copy_files
from tx.models.config import ModelConfig
from tx.models.layers.lora import LoraA, LoraB
from tx.models.layers.moe import RouterBias
from tx.models.safetensors_io import write_streaming
from tx.models.sharding import to_host

FORMAT = "tx-full-checkpoint-v1"
SAMPLER_FORMAT = "tx-full-sampler-v1"
RESERVED = ("format", "step", "tensors")  # metadata keys this module writes itself
DEFAULT_SHARD_BYTES = 5 * 10**9  # per safetensors file, as transformers' save_pretrained
DEFAULT_CHUNK_BYTES = 256 * 2**20  # largest block gathered to the host at once
BASE_WEIGHTS = nnx.All(nnx.Param, nnx.Not(nnx.Any(LoraA, LoraB)))  # the model's own weights, not LoRA


# ---- training state ----


@dataclass
class FullCheckpoint:
    metadata: dict
    params: Any
    opt_state: Any | None  # None when no optimizer target was given
    step: int


def save_full_checkpoint(path, params_state: Any, opt_state: Any, step: int, metadata: dict,
                         *, version: str | None = None) -> None:
    """Write `params_state` and `opt_state` (pytrees of jax arrays, e.g. an nnx.State and an optax state),
    `step` and `metadata` (JSON: base model, its `training.base_signature`, optimizer config, ...) to the
    checkpoint directory `path` (local or cloud). Every process calls it with the same `version`."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")
    clash = sorted(set(metadata) & set(RESERVED))
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by the checkpoint format")
    if version is None and jax.process_count() > 1:
        raise ValueError("a multi-process save needs a `version` shared by every process")
    groups = {g: {k: v if hasattr(v, "dtype") else np.asarray(v) for k, v in _flatten(tree).items()}
              for g, tree in (("params", params_state), ("opt_state", opt_state))}
    meta = {"tx_version": __version__, **metadata, "format": FORMAT, "step": int(step),
            "tensors": {g: {k: {"shape": list(np.shape(v)), "dtype": str(v.dtype)} for k, v in d.items()}
                        for g, d in groups.items()}}
    primary = ranks.is_primary_writer()  # orbax's primary host (tx.ranks)
    with storage.write_dir(path, version=version, primary=primary) as local:
        checkpointer = standard_checkpointer()
        for group, arrays in groups.items():
            if arrays:  # an empty optimizer state (plain SGD) has nothing to write
                checkpointer.save((local / group).absolute(), arrays)
                checkpointer.wait_until_finished()
        if primary:
            (local / "metadata.json").write_text(json.dumps(meta, indent=2))


def read_full_metadata(path) -> dict:
    return read_metadata(path, FORMAT)


def abstract_state(tree: Any) -> Any:
    """The tree with each array replaced by its shape, dtype and sharding: a restore target that holds no
    memory (drop the live arrays first, and a restore never needs room for two copies of the state)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _abstract(path, group: str, tree: Any, saved: dict) -> dict[str, jax.ShapeDtypeStruct]:
    flat = _flatten(tree)
    if set(flat) != set(saved):
        differs = sorted(set(flat) ^ set(saved))[:3]
        raise CheckpointError(f"checkpoint at {path} does not match this model's {group} (differs at {differs})")
    out = {}
    for key, target in flat.items():
        if list(target.shape) != saved[key]["shape"]:
            raise CheckpointError(f"checkpoint tensor {group}{key} has shape {saved[key]['shape']}, "
                                  f"this model needs {list(target.shape)}")
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            raise ValueError(f"restore target {group}{key} has no sharding: pass jax arrays or "
                             f"jax.ShapeDtypeStruct(shape, dtype, sharding=...)")
        out[key] = jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=sharding)
    return out


def load_full_checkpoint(path, params_target: Any, opt_target: Any | None = None,
                         *, expected_base: dict | None = None) -> FullCheckpoint:
    """Restore onto the shapes, dtypes (cast if they differ from the saved ones) and shardings of the
    targets: pytrees like the saved ones whose leaves are jax arrays or `jax.ShapeDtypeStruct`s with a
    sharding. `opt_target=None` skips the optimizer state (it is not read). `expected_base`
    (`training.base_signature` of the serving model) must equal the saved `metadata["base"]` when given.
    Everything is validated before anything is returned."""
    meta = read_full_metadata(path)
    if expected_base is not None and meta.get("base") != expected_base:
        raise CheckpointError(f"checkpoint at {path} was saved for base model {meta.get('base_model')!r} "
                              f"({meta.get('base')}), this model is {expected_base}")
    trees = {"params": params_target, "opt_state": opt_target}
    abstract = {g: _abstract(path, g, t, meta["tensors"].get(g, {})) for g, t in trees.items() if t is not None}
    restored = {}
    with storage.read_dir(path) as local:
        for group, target in abstract.items():
            try:
                restored[group] = standard_checkpointer().restore((local / group).absolute(), target) if target else {}
            except Exception as e:  # orbax raises many types for damaged files
                raise CheckpointError(f"checkpoint at {path} could not be read ({group}): {str(e)[:300]}") from e

    def rebuild(group: str):
        if group not in restored:
            return None
        leaves = [restored[group][k] for k in abstract[group]]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(trees[group]), leaves)

    return FullCheckpoint(meta, rebuild("params"), rebuild("opt_state"), int(meta["step"]))


# ---- HF safetensors export ----


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint: `param[lead]` (transposed when `transpose`), HF `shape`."""

    name: str
    param: tuple[str, ...]  # nnx path of the tx parameter
    lead: tuple[int, ...]  # its layer (and expert) index in the stacked parameter
    transpose: bool
    shape: tuple[int, ...]


def hf_layout(model: nnx.Module, shapes: dict[tuple[str, ...], tuple[int, ...]]) -> list[HFTensor]:
    """The HF tensors of the base parameters with these nnx paths and shapes, in checkpoint order
    (embeddings, layers by index, final norm, LM head; experts projection by projection)."""
    keyed = []
    for path, shape in shapes.items():
        if path == ("embed_tokens", "embedding"):
            keyed.append(((0,), HFTensor("model.embed_tokens.weight", path, (), False, shape)))
        elif path == ("norm", "weight"):
            keyed.append(((2,), HFTensor("model.norm.weight", path, (), False, shape)))
        elif path == ("lm_head", "kernel"):
            keyed.append(((3,), HFTensor("lm_head.weight", path, (), True, shape[::-1])))
        elif len(path) > 4 and path[0] == "stacks" and path[2] == "layer":
            rest = path[3:]
            module, transpose = ".".join(rest[:-1]), rest[-1] == "kernel"
            leaf = ".weight" if rest[-1] in ("kernel", "weight") else "." + rest[-1]  # e.g. e_score_correction_bias
            for j, i in enumerate(model.stacks[int(path[1])].layer_ids):
                prefix = f"model.layers.{i}."
                if rest[:2] == ("mlp", "experts"):  # [L, E, in, out]
                    for e in range(shape[1]):
                        name = f"{prefix}mlp.experts.{e}.{rest[2]}.weight"
                        keyed.append(((1, i, module, e), HFTensor(name, path, (j, e), True, shape[2:][::-1])))
                else:
                    inner = shape[1:][::-1] if transpose else shape[1:]
                    keyed.append(((1, i, module, leaf), HFTensor(prefix + module + leaf, path, (j,), transpose, inner)))
        else:
            raise CheckpointError(f"no HF tensor name known for parameter {'.'.join(path)}")
    return [t for _, t in sorted(keyed, key=lambda kt: kt[0])]


class _Gather:
    """HF tensors fetched from (possibly sharded, multi-host) device arrays, at most `chunk_bytes` per
    gather; a block holding several tensors (one layer's experts) is gathered once for all of them."""

    def __init__(self, arrays: dict[tuple[str, ...], jax.Array], chunk_bytes: int):
        self.arrays, self.chunk_bytes = arrays, chunk_bytes
        self._key: tuple | None = None
        self._block: np.ndarray | None = None

    def blocks(self, t: HFTensor, dtype: np.dtype) -> Iterator[np.ndarray]:
        x = self.arrays[t.param]
        itemsize = np.dtype(x.dtype).itemsize

        def hf(block: np.ndarray) -> np.ndarray:
            return (np.swapaxes(block, -1, -2) if t.transpose else block).astype(dtype, copy=False)

        for k in range(len(t.lead) + 1):
            if math.prod(x.shape[k:]) * itemsize <= self.chunk_bytes:
                if self._key != (t.param, t.lead[:k]):
                    self._block = None  # free the previous block before gathering the next
                    self._block = to_host(x[t.lead[:k]])
                    self._key = (t.param, t.lead[:k])
                yield hf(self._block[t.lead[k:]])
                return
        rows = t.shape[0]  # one tensor larger than a chunk: ranges of its HF rows
        step = max(1, self.chunk_bytes // (math.prod(t.shape[1:]) * itemsize))
        for r in range(0, rows, step):
            cols = slice(r, min(r + step, rows))
            yield hf(to_host(x[(*t.lead, slice(None), cols) if t.transpose else (*t.lead, cols)]))


def _split_files(tensors: list[HFTensor], nbytes: dict[str, int], max_shard_bytes: int) -> list[list[HFTensor]]:
    files: list[list[HFTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + nbytes[t.name] > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes[t.name]
    return files


def export_hf_model(path, model: nnx.Module, base_model_dir, *, dtype: str | None = None, weights: Any = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """Write the model's base weights (`weights`, an nnx.State with the same paths, replaces them: e.g.
    float32 master weights) as an HF model directory at local `path`: `model-0000k-of-0000n.safetensors`,
    `model.safetensors.index.json`, the base's config.json with `dtype` set, its generation config and
    tokenizer files. `dtype` (default: each weight's own) casts on the way out. Every process must call it
    (gathers are collective); process 0 writes. Returns the index."""
    base_dir = Path(base_model_dir)
    base_cfg = ModelConfig.from_dir(base_dir)
    if base_signature(base_cfg) != base_signature(model.config):
        raise ValueError(f"base model directory {base_dir} describes {base_signature(base_cfg)}, "
                         f"the model is {base_signature(model.config)}")
    state = nnx.state(model, BASE_WEIGHTS) if weights is None else weights
    arrays = {tuple(str(p) for p in k): v.get_value() if isinstance(v, nnx.Variable) else v
              for k, v in nnx.to_flat_state(state)}
    # the checkpoint's other tensors, never trained (DeepSeek-V3's expert-selection bias)
    arrays |= {tuple(str(p) for p in k): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, RouterBias))}
    tensors = hf_layout(model, {k: tuple(v.shape) for k, v in arrays.items()})
    out_dtype = {t.name: jnp.dtype(dtype or arrays[t.param].dtype) for t in tensors}
    nbytes = {t.name: math.prod(t.shape) * out_dtype[t.name].itemsize for t in tensors}
    files = _split_files(tensors, nbytes, max_shard_bytes)
    gather = _Gather(arrays, chunk_bytes)
    primary = ranks.is_primary_writer()
    out = Path(path)
    if primary:
        out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, group in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        blocks = ((t.name, b) for t in group for b in gather.blocks(t, out_dtype[t.name]))
        if primary:
            write_streaming(out / fname, [(t.name, out_dtype[t.name], t.shape) for t in group], blocks)
        else:
            for _ in blocks:  # the same gathers as process 0
                pass
        weight_map |= {t.name: fname for t in group}
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    if primary:
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf_cfg = json.loads((base_dir / "config.json").read_text())
        hf_cfg["dtype"] = str(out_dtype[tensors[0].name])  # transformers 5's key; 4.x reads torch_dtype
        if "torch_dtype" in hf_cfg:
            hf_cfg["torch_dtype"] = hf_cfg["dtype"]
        (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        copy_files(base_dir, out, SIDE_FILES)
    return index


# ---- sampler checkpoints: the exported model as a tar file or a directory ----


def save_sampler_model(output_path, model: nnx.Module, base_model_dir, info: dict, *, as_dir: bool = False,
                       **export_kwargs) -> None:
    """Export the model (`export_hf_model` arguments in `export_kwargs`) with `info` in
    `tx_metadata.json`, and put it at `output_path` (local or cloud): an uncompressed tar file written
    atomically (as LoRA sampler checkpoints), or with `as_dir` a directory transformers loads directly.
    Every process must call it; process 0 writes."""
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "model"
        export_hf_model(hf, model, base_model_dir, **export_kwargs)
        if not ranks.is_primary_writer():
            return
        meta = {"tx_version": __version__, **info, "format": SAMPLER_FORMAT}
        (hf / "tx_metadata.json").write_text(json.dumps(meta, indent=2))
        if as_dir:
            _replace_dir(output_path, hf)
        else:
            storage.pack_tar(hf, Path(tmp) / "model.tar", compress=False)
            storage.write_file_atomic(output_path, Path(tmp) / "model.tar")


def _replace_dir(target_path, source: Path) -> None:
    """Local: copy next to the target, then swap by renames (a reader sees the old or the new directory;
    a crash between the two renames leaves the old one as `.<name>.old-*`). Cloud: replace the objects."""
    target = storage.as_path(target_path)
    if storage.is_remote(target):
        if target.exists():
            storage.remove(target)
        target.upload_from(source)
        return
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = target.with_name(f".{target.name}{storage.TMP_MARK}{tag}")
    old = target.with_name(f".{target.name}.old-{tag}")
    try:
        shutil.copytree(source, staging)
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not target.exists():
            os.replace(old, target)  # put the previous version back
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def open_sampler_model(path) -> Iterator[tuple[Path, dict]]:
    """(local HF model directory, its tx metadata) of a sampler checkpoint `save_sampler_model` wrote."""
    target = storage.as_path(path)
    with contextlib.ExitStack() as stack:
        if target.is_dir() and not storage.is_remote(target):
            local = Path(target)
        else:
            local = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            if target.is_dir():
                target.download_to(local)
            else:
                tar = stack.enter_context(storage.read_file(path))
                try:
                    storage.unpack_tar(tar, local)
                except (tarfile.TarError, OSError, EOFError) as e:
                    raise CheckpointError(f"sampler checkpoint {path} is not a readable tar file: {e}") from None
        meta_file = local / "tx_metadata.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        if meta.get("format") != SAMPLER_FORMAT:
            raise CheckpointError(f"sampler checkpoint {path} has format {meta.get('format')!r}, "
                                  f"expected {SAMPLER_FORMAT!r}")
        yield local, meta
