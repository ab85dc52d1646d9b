"""Build a model abstractly and fill it from HF safetensors, one parameter at a time, already sharded.

Nothing is randomly initialised: the model is traced with `nnx.eval_shape`, then each parameter is
created with `jax.make_array_from_callback`, whose callback reads only the slice a local device owns
from the memory-mapped checkpoint (transposing HF's `[out, in]` linears and stacking layers and experts
on the fly). Host memory therefore holds at most one device shard of one parameter at a time. The LoRA
factors and scales, zero until an adapter is created, are made by XLA on the devices (`zeros_global`).

Checkpoint tensors the model does not read are listed in one warning (as transformers' "Some weights of
the model checkpoint ... were not used"), except those a checkpoint may legitimately carry (`_NOT_NEEDED`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from tx.kernels.platform import platform_of
from tx.models.config import LoraSlots, ModelConfig
from tx.models.layers.lora import LoraA, LoraB, LoraScale
from tx.models.registry import model_class
from tx.models.safetensors_io import SafetensorsDir
from tx.models.logical import DEFAULT_RULES, NO_SHARDING, LogicalSharding, Rules
from tx.models.sharding import logical_sharding, make_mesh, param_sharding, zeros_global

logger = logging.getLogger(__name__)

class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


Index = tuple[slice, ...]


class Source(Protocol):
    """A lazily read tensor: its shape, and a reader for any rectangular slice of it."""

    shape: tuple[int, ...]

    def read(self, index: Index) -> np.ndarray: ...

    def names(self) -> Iterator[str]:
        """The checkpoint tensors it reads."""
        ...


@dataclass
class Stored:
    files: SafetensorsDir
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.files.shape(self.name)

    def read(self, index: Index) -> np.ndarray:
        return np.asarray(self.files.get(self.name)[index])

    def names(self) -> Iterator[str]:
        yield self.name


@dataclass
class Transposed:
    """Swap the last two axes (HF linears are `[out, in]`, tx kernels `[in, out]`)."""

    inner: Source

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.inner.shape
        return (*s[:-2], s[-1], s[-2])

    def read(self, index: Index) -> np.ndarray:
        inner_index = (*index[:-2], index[-1], index[-2])
        return np.swapaxes(self.inner.read(inner_index), -1, -2)

    def names(self) -> Iterator[str]:
        return self.inner.names()


@dataclass
class Narrowed:
    """Rows `[start, start + size)` of `axis` (one half of a fused gate_up tensor)."""

    inner: Source
    axis: int
    start: int
    size: int

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.inner.shape)
        s[self.axis] = self.size
        return tuple(s)

    def read(self, index: Index) -> np.ndarray:
        sl = index[self.axis]
        shifted = list(index)
        shifted[self.axis] = slice(sl.start + self.start, sl.stop + self.start)
        return self.inner.read(tuple(shifted))

    def names(self) -> Iterator[str]:
        return self.inner.names()


@dataclass
class Stacked:
    """Several same-shaped sources stacked on a new leading axis (layers, experts)."""

    parts: list[Source]

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = {p.shape for p in self.parts}
        if len(shapes) != 1:
            raise CheckpointError(f"stacked tensors have different shapes: {sorted(shapes)}")
        return (len(self.parts), *shapes.pop())

    def read(self, index: Index) -> np.ndarray:
        return np.stack([self.parts[i].read(index[1:]) for i in range(*index[0].indices(len(self.parts)))])

    def names(self) -> Iterator[str]:
        for part in self.parts:
            yield from part.names()


def _expert_source(files: SafetensorsDir, prefix: str, proj: str, cfg: ModelConfig) -> Source:
    """One layer's `[E, in, out]` expert kernel: per-expert tensors (released Qwen3 checkpoints) or
    the fused 3-D layout transformers 5 uses in memory (`gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`)."""
    per_expert = [f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(cfg.num_experts)]
    if per_expert[0] in files:
        return Stacked([Transposed(Stored(files, n)) for n in per_expert])
    ff = cfg.moe_intermediate_size
    if proj == "down_proj":
        return Transposed(Stored(files, f"{prefix}mlp.experts.down_proj"))
    fused = Stored(files, f"{prefix}mlp.experts.gate_up_proj")
    return Transposed(Narrowed(fused, axis=1, start=0 if proj == "gate_proj" else ff, size=ff))


def hf_source(path: tuple[str, ...], model: Any, files: SafetensorsDir) -> Source:
    """Where the base parameter at nnx `path` lives in an HF checkpoint."""
    cfg: ModelConfig = model.config
    if path == ("embed_tokens", "embedding"):
        return Stored(files, "model.embed_tokens.weight")
    if path == ("norm", "weight"):
        return Stored(files, "model.norm.weight")
    if path == ("lm_head", "kernel"):
        return Transposed(Stored(files, "lm_head.weight"))
    if path[0] != "stacks":
        raise CheckpointError(f"no HF tensor known for parameter {'.'.join(path)}")
    layer_ids = model.stacks[int(path[1])].layer_ids
    rest = path[3:]  # after ("stacks", s, "layer")
    parts: list[Source] = []
    for i in layer_ids:
        prefix = f"model.layers.{i}."
        if rest[:2] == ("mlp", "experts"):
            parts.append(_expert_source(files, prefix, rest[2], cfg))
        else:
            leaf = ".weight" if rest[-1] in ("kernel", "weight") else "." + rest[-1]  # e.g. e_score_correction_bias
            src: Source = Stored(files, prefix + ".".join(rest[:-1]) + leaf)
            parts.append(Transposed(src) if rest[-1] == "kernel" else src)
    return Stacked(parts)


def _layout_hint(cfg: ModelConfig, files: SafetensorsDir) -> str:
    """Name the likely cause when config.json and the tensors disagree on dense vs MoE."""
    has_experts = any(".mlp.experts." in name for name in files.keys())
    if has_experts and not cfg.num_experts:
        return " (the checkpoint has expert tensors but config.json describes a dense model)"
    if cfg.num_experts and not has_experts:
        return f" (config.json describes {cfg.num_experts} experts but the checkpoint has no expert tensors)"
    return ""


# Tensors a checkpoint may carry that the model legitimately does not read (no warning): RoPE's
# `rotary_emb.inv_freq` buffers (older transformers saved them; tx computes RoPE from config.json), and
# `lm_head.weight` of a model with tied embeddings (the LM head is the embedding matrix; some tied
# checkpoints store the copy anyway).
_NOT_NEEDED = re.compile(r"(.*\.)?rotary_emb\.inv_freq")
_TIED_HEAD = "lm_head.weight"
_UNUSED_SHOWN = 10


def warn_unused_tensors(model_dir: Path, cfg: ModelConfig, files: SafetensorsDir, used: set[str]) -> list[str]:
    """Log one warning naming the checkpoint tensors outside `used` (the first few and the count);
    returns them all (sorted)."""
    unused = sorted(
        name for name in files.keys()
        if name not in used and not _NOT_NEEDED.fullmatch(name)
        and not (cfg.tie_word_embeddings and name == _TIED_HEAD)
    )
    if unused:
        shown = ", ".join(unused[:_UNUSED_SHOWN]) + (", ..." if len(unused) > _UNUSED_SHOWN else "")
        logger.warning("Some weights of the model checkpoint at %s were not used when loading %s (%d tensors): %s",
                       model_dir, cfg.architecture, len(unused), shown)
    return unused


def _concrete(index: tuple, shape: tuple[int, ...]) -> Index:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A local directory as is; otherwise download an HF hub repo (configs, tokenizer, safetensors)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/")):
        raise FileNotFoundError(f"model path {name_or_path} is not a directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))


def build_abstract(
    cfg: ModelConfig,
    slots: LoraSlots,
    *,
    dtype: str | None = None,
    remat_policy: str = "none",
    attention_impl: str = "auto",
    moe_impl: str = "auto",
    experts_whole: bool = True,
    platform: str | None = None,
    sharding: LogicalSharding = NO_SHARDING,
) -> nnx.Module:
    cls = model_class(cfg.architecture)
    return nnx.eval_shape(
        lambda: cls(
            cfg, slots, dtype=dtype, remat_policy=remat_policy, attention_impl=attention_impl, moe_impl=moe_impl,
            experts_whole=experts_whole, platform=platform, sharding=sharding, rngs=nnx.Rngs(0),
        )
    )


def load_model(
    name_or_path: str | Path,
    slots: LoraSlots | None = None,
    mesh: Mesh | None = None,
    *,
    dtype: str | None = None,
    remat_policy: str = "none",
    attention_impl: str = "auto",
    moe_impl: str = "auto",
    shard_attention_heads: bool = True,
    experts_whole: bool = True,
    platform: str | None = None,
    rules: Rules = DEFAULT_RULES,
) -> nnx.Module:
    """Load an HF Qwen3 / Qwen3-MoE checkpoint onto `mesh` (default: one device) with empty LoRA slots.
    `experts_whole=False`: MoE expert kernels are scanned per layer (full fine-tuning trains them).
    `platform`: what the model's programs are built for (default: the mesh's devices'; another one only to
    lower them, e.g. for "tpu" from a CPU host with `jax.export`). `rules`: the logical-axis rules table
    (`tx.models.logical`) that places the weights and that the model's activation constraints follow."""
    model_dir = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_dir(model_dir)
    slots = slots or LoraSlots()
    mesh = mesh or make_mesh(devices=jax.devices()[:1])
    layout = logical_sharding(mesh, cfg, shard_attention_heads, rules)
    abstract = build_abstract(cfg, slots, dtype=dtype, remat_policy=remat_policy, attention_impl=attention_impl,
                              moe_impl=moe_impl, experts_whole=experts_whole,
                              platform=platform_of(mesh) if platform is None else platform, sharding=layout)
    graphdef, state = nnx.split(abstract)
    files = SafetensorsDir(model_dir)
    loaded = {}
    used: set[str] = set()
    flat = list(nnx.to_flat_state(state))
    for path, var in tqdm(flat, desc=f"loading {model_dir.name}", unit="param", disable=None, leave=False):
        names = tuple(str(p) for p in path)
        want = var.get_value()
        sharding = param_sharding(names, want.shape, mesh, cfg, shard_attention_heads, rules)
        if isinstance(var, (LoraA, LoraB, LoraScale)):
            value = zeros_global(want.shape, want.dtype, sharding)  # XLA's buffers: slot writes donate them
        else:
            src = hf_source(names, abstract, files)
            used.update(src.names())
            try:
                src_shape = src.shape
            except KeyError as e:
                raise CheckpointError(f"missing tensor in {model_dir}: {e.args[0]}{_layout_hint(cfg, files)}") from None
            if tuple(src_shape) != tuple(want.shape):
                raise CheckpointError(
                    f"parameter {'.'.join(names)}: checkpoint gives shape {tuple(src_shape)} "
                    f"but config.json implies {tuple(want.shape)}"
                )
            np_dtype = np.dtype(want.dtype)
            value = jax.make_array_from_callback(
                want.shape, sharding, lambda idx, src=src, shp=want.shape: src.read(_concrete(idx, shp)).astype(np_dtype),
                dtype=want.dtype,
            )
        loaded[path] = var.replace(value)
    warn_unused_tensors(model_dir, cfg, files, used)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))

