"""One adapter's training state with orbax: LoRA weights and scales of its slot (sliced to its rank),
Adam state (sliced likewise, plus the step count), and metadata to validate a restore.

Arrays are written by orbax from the device arrays (each shard by its owner) and restored onto the
current mesh, so a checkpoint is readable with another mesh, slot, max_lora_rank or process count.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tx import ranks
from tx.version import __version__
from tx.checkpoints import storage
from tx.models.config import ModelConfig

FORMAT = "tx-training-checkpoint-v1"
# Fields of the base model that must match for a restore to make sense.
BASE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")


class CheckpointError(ValueError):
    """A checkpoint that is corrupt or does not fit this model."""


def standard_checkpointer() -> Any:
    """orbax's StandardCheckpointer, orbax imported on first use: importing it costs every process that imports tx
    ~0.2 s (servers, hosts, CLIs), and most never save or load a training checkpoint."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _flatten(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _rank_axis(name: str) -> int | None:
    """Axis holding the LoRA rank in a slot slice: A [.., in, R] -> -1, B [.., R, out] -> -2."""
    if "lora_a" in name:
        return -1
    if "lora_b" in name:
        return -2
    return None


def _slice_rank(x, axis: int | None, rank: int):
    if axis is None:
        return x
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, rank)
    return x[tuple(index)]


def base_signature(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in BASE_FIELDS}


def save(path, *, weights: Any, scales: Any, opt_state: Any, rank: int, metadata: dict, version: str | None = None) -> None:
    """Write slot slices `weights` (LoRA A/B), `scales` and `opt_state` (Adam, shaped like weights)."""
    arrays = {
        "weights": {k: _slice_rank(v, _rank_axis(k), rank) for k, v in _flatten(weights).items()},
        "scales": _flatten(scales),
        "opt_state": {k: _slice_rank(v, _rank_axis(k), rank) for k, v in _flatten(opt_state).items()},
    }
    meta = {"format": FORMAT, "tx_version": __version__, "rank": rank,
            "shapes": {g: {k: list(v.shape) for k, v in d.items()} for g, d in arrays.items()}, **metadata}
    primary = ranks.is_primary_writer()  # orbax's primary host (tx.ranks)
    with storage.write_dir(path, version=version, primary=primary) as local:
        checkpointer = standard_checkpointer()
        checkpointer.save((local / "state").absolute(), arrays)
        checkpointer.wait_until_finished()
        if primary:
            (local / "metadata.json").write_text(json.dumps(meta, indent=2))


def read_metadata(path, fmt: str = FORMAT) -> dict:
    """A tx checkpoint's metadata.json, checked to be of format `fmt` (LoRA training state by default)."""
    with storage.read_dir(path) as local:
        meta_file = local / "metadata.json"
        if not meta_file.exists():
            raise CheckpointError(f"checkpoint at {path} has no metadata.json (corrupt or not a tx checkpoint)")
        meta = json.loads(meta_file.read_text())
    if meta.get("format") != fmt:
        raise CheckpointError(f"checkpoint at {path} has format {meta.get('format')!r}, expected {fmt!r}")
    return meta


def load(path, *, weights: Any, scales: Any, opt_state: Any, mesh: Mesh, load_optimizer: bool) -> tuple[dict, Any, Any, Any]:
    """Restore into trees shaped like the current slot slices (`weights`, `scales`, `opt_state`): zero-pad
    ranks back to max_lora_rank. Returns (metadata, weights, scales, opt_state or None). Validates every
    shape before returning, so a bad checkpoint changes nothing."""
    meta = read_metadata(path)
    rank = meta["rank"]
    replicated = NamedSharding(mesh, P())
    templates = {"weights": _flatten(weights), "scales": _flatten(scales), "opt_state": _flatten(opt_state)}
    target, absent = {}, set()
    for group in templates:  # Adam state is read even when it is not used: it is small, and it validates
        saved = meta["shapes"].get(group, {})
        # checkpoints from before the value head existed: it (and its Adam moments) start at zero
        absent |= {(group, k) for k in templates[group] if "value_head" in k and k not in saved}
        if set(saved) != {k for k in templates[group] if (group, k) not in absent}:
            missing = sorted(set(templates[group]) ^ set(saved))[:3]
            raise CheckpointError(f"checkpoint at {path} does not match this model's {group} (differs at {missing})")
        target[group] = {}
        for k, t in templates[group].items():
            if (group, k) in absent:
                continue
            want = list(_slice_rank(np.empty(t.shape, np.bool_), _rank_axis(k), rank).shape)
            if saved[k] != want:
                raise CheckpointError(f"checkpoint tensor {group}{k} has shape {saved[k]}, this model needs {want}")
            target[group][k] = jax.ShapeDtypeStruct(tuple(want), t.dtype, sharding=replicated)
    with storage.read_dir(path) as local:
        try:
            restored = standard_checkpointer().restore((local / "state").absolute(), target)
        except Exception as e:  # noqa: BLE001 - orbax raises many types for damaged files
            raise CheckpointError(f"checkpoint at {path} could not be read: {str(e)[:300]}") from e
    if not load_optimizer:
        del restored["opt_state"]

    def rebuild(tree, group):
        if group not in restored:
            return None
        leaves = []
        for k, t in templates[group].items():
            if (group, k) in absent:
                leaves.append(jnp.zeros(t.shape, t.dtype))
                continue
            x = restored[group][k]
            axis = _rank_axis(k)
            if axis is not None:
                pad = [(0, 0)] * x.ndim
                pad[axis] = (0, t.shape[axis] - x.shape[axis])
                x = jnp.pad(x, pad)
            leaves.append(x.astype(t.dtype))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)

    return meta, rebuild(weights, "weights"), rebuild(scales, "scales"), rebuild(opt_state, "opt_state")
