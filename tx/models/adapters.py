"""Operations on one adapter slot of a model: PEFT-style init, clear, and weights by HF module name.

Each LoRA-carrying module is named as in HF/PEFT (`model.layers.3.self_attn.q_proj`, `lm_head`, and for
MoE `model.layers.3.mlp.experts.gate_proj` with a leading expert axis). Weights are exchanged in PEFT's
layout: `A [r, in]`, `B [out, r]` (experts: `[E, r, in]`, `[E, out, r]`).

Which modules an adapter trains: `train_attn` (q/k/v/o), `train_mlp` (dense MLP and experts),
`train_unembed` (LM head). Modules it does not train keep A = B = 0 and scale 0, so they contribute
exactly nothing and receive exactly zero gradient.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx.models.layers.lora import LoraA, LoraScale
from tx.models.sharding import to_host


def module_group(path: tuple[str, ...]) -> str:
    """"attn", "mlp" or "unembed": the Tinker flag that controls a LoRA module."""
    if path[0] == "lm_head":
        return "unembed"
    return "attn" if "self_attn" in path else "mlp"


def lora_modules(model: Any) -> Iterator[tuple[tuple[str, ...], nnx.Module, tuple[int, ...] | None]]:
    """(nnx path, module, stacked layer ids or None) for every module that holds LoRA weights."""
    for path, module in nnx.iter_modules(model):
        if hasattr(module, "lora_a") and isinstance(module.lora_a, LoraA):
            names = tuple(str(p) for p in path)
            layer_ids = model.stacks[int(names[1])].layer_ids if names[0] == "stacks" else None
            yield names, module, layer_ids


def hf_module_names(path: tuple[str, ...], layer_ids: tuple[int, ...] | None) -> list[str]:
    """HF module name of each layer held by the LoRA module at `path`."""
    if layer_ids is None:
        return [".".join(path)]
    suffix = ".".join(path[3:])  # after ("stacks", s, "layer")
    return [f"model.layers.{i}.{suffix}" for i in layer_ids]


def _adapter_axis(var: nnx.Variable) -> int:
    return -1 if isinstance(var, LoraScale) else -3


def _slot_shape(var: nnx.Variable) -> list[int]:
    """The variable's shape without its adapter axis."""
    shape = list(var.get_value().shape)
    del shape[_adapter_axis(var)]
    return shape


def _set_slot(var: nnx.Variable, slot: int, value_at_slot: jax.Array | np.ndarray) -> None:
    """Write `value_at_slot` (shaped `_slot_shape(var)`) into adapter `slot`. Host values go in as numpy, so
    the update is the same SPMD program on every process of a multi-host run."""
    full = var.get_value()
    value_at_slot = np.asarray(value_at_slot).astype(full.dtype)
    var.set_value(_write_slot(full, value_at_slot, np.int32(slot), _adapter_axis(var) % full.ndim))


@partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _write_slot(full: jax.Array, value_at_slot: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """`full` with index `slot` of `axis` replaced, in place: `full` is donated, so writing one slot never
    holds a second copy of all slots (the slot is traced: one compile per shape serves every slot)."""
    return jax.lax.dynamic_update_index_in_dim(full, value_at_slot, slot, axis)


def clear_adapter(model: Any, slot: int) -> None:
    """Zero every LoRA weight and scale (and the value head) of `slot`: the slot then computes exactly the base
    model."""
    for _, module, _ in lora_modules(model):
        for var in (module.lora_a, module.lora_b, module.lora_scale,
                    *([module.value_head] if hasattr(module, "value_head") else [])):
            _set_slot(var, slot, np.zeros(_slot_shape(var), np.float32))


def init_adapter(
    model: Any,
    slot: int,
    *,
    rank: int,
    alpha: float,
    seed: int,
    train_attn: bool = True,
    train_mlp: bool = True,
    train_unembed: bool = True,
) -> None:
    """PEFT's default init in `slot`: A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)) with the
    fan-in of one layer (and one expert), columns >= rank zero; B = 0; scale alpha / rank; value head 0."""
    max_rank = model.slots.max_lora_rank
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} must be in [1, max_lora_rank={max_rank}]")
    if slot == 0:
        raise ValueError("slot 0 is the base model and holds no adapter")
    trained = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
    key = jax.random.key(seed)
    for n, (path, module, _) in enumerate(lora_modules(model)):
        shape = _slot_shape(module.lora_a)  # [L?, E?, in, R]
        fan_in = shape[-2]
        a = np.zeros(shape, np.float32)
        b = np.zeros(_slot_shape(module.lora_b), np.float32)
        scale = np.zeros(_slot_shape(module.lora_scale), np.float32)
        if trained[module_group(path)]:
            bound = 1.0 / np.sqrt(fan_in)
            drawn = jax.random.uniform(jax.random.fold_in(key, n), (*shape[:-1], rank), jnp.float32, -bound, bound)
            a[..., :rank] = np.asarray(drawn)  # drawn on this host, identically on every host
            scale = scale + alpha / rank
        _set_slot(module.lora_a, slot, a)
        _set_slot(module.lora_b, slot, b)
        _set_slot(module.lora_scale, slot, scale)
        if hasattr(module, "value_head"):  # a critic's value head starts at V = 0
            _set_slot(module.value_head, slot, np.zeros(_slot_shape(module.value_head), np.float32))


def plan_adapter_weights(
    model: Any, weights: dict[str, tuple[np.ndarray, np.ndarray]], *, alpha: float, rank: int
) -> list[tuple[nnx.Variable, np.ndarray]]:
    """Validate PEFT-layout weights `{hf_module: (A, B)}` and build every slot value they define, writing
    nothing: `[(variable, value at the slot)]` for `write_adapter_slot`. Modules absent from `weights` get
    zeros; ranks below max_lora_rank are zero-padded; an unknown module name, a wrong shape or a non-finite
    value raises. Loading is thus all-or-nothing: a bad file never leaves a slot half-written."""
    max_rank = model.slots.max_lora_rank
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} must be in [1, max_lora_rank={max_rank}]")
    remaining = dict(weights)
    plan: list[tuple[nnx.Variable, np.ndarray]] = []
    for path, module, layer_ids in lora_modules(model):
        names = hf_module_names(path, layer_ids)
        a = np.zeros(_slot_shape(module.lora_a), np.float32)  # [L?, E?, in, R]
        b = np.zeros(_slot_shape(module.lora_b), np.float32)  # [L?, E?, R, out]
        present = False
        for li, name in enumerate(names):
            if name not in remaining:
                continue
            a_peft, b_peft = (np.asarray(x, np.float32) for x in remaining.pop(name))
            a_t, b_t = np.swapaxes(a_peft, -1, -2), np.swapaxes(b_peft, -1, -2)  # [.., in, r], [.., r, out]
            dst_a = a[li] if layer_ids is not None else a
            dst_b = b[li] if layer_ids is not None else b
            if a_t.shape != (*dst_a.shape[:-1], rank) or b_t.shape != (*dst_b.shape[:-2], rank, dst_b.shape[-1]):
                raise ValueError(
                    f"adapter weights for {name}: A {a_peft.shape} / B {b_peft.shape} do not match rank {rank} "
                    f"and module shape in={dst_a.shape[-2]}, out={dst_b.shape[-1]}"
                )
            if not (np.isfinite(a_t).all() and np.isfinite(b_t).all()):
                raise ValueError(f"adapter weights for {name} contain NaN or infinite values")
            dst_a[..., :rank] = a_t
            dst_b[..., :rank, :] = b_t
            present = True
        scale = np.full(_slot_shape(module.lora_scale), alpha / rank if present else 0.0)
        plan += [(module.lora_a, a), (module.lora_b, b), (module.lora_scale, scale)]
    if remaining:
        raise ValueError(f"adapter weights name modules this model does not have: {sorted(remaining)[:5]}")
    return plan


def write_adapter_slot(plan: list[tuple[nnx.Variable, np.ndarray]], slot: int) -> None:
    """Write the values of `plan_adapter_weights` into adapter `slot`."""
    for var, value in plan:
        _set_slot(var, slot, value)


def set_adapter_weights(
    model: Any, slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]], *, alpha: float, rank: int
) -> None:
    """Load PEFT-layout weights `{hf_module: (A, B)}` into `slot` (all validated before anything is written)."""
    write_adapter_slot(plan_adapter_weights(model, weights, alpha=alpha, rank=rank), slot)


def get_adapter_weights(model: Any, slot: int, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{hf_module: (A [.., r, in], B [.., out, r])}` of `slot`, sliced to `rank`, for modules it trains."""
    out = {}
    for path, module, layer_ids in lora_modules(model):
        a = to_host(jnp.take(module.lora_a.get_value(), slot, axis=-3))[..., :rank]
        b = to_host(jnp.take(module.lora_b.get_value(), slot, axis=-3))[..., :rank, :]
        scale = to_host(jnp.take(module.lora_scale.get_value(), slot, axis=-1))
        if not np.any(scale):
            continue
        for li, name in enumerate(hf_module_names(path, layer_ids)):
            a_l, b_l = (a[li], b[li]) if layer_ids is not None else (a, b)
            out[name] = (np.swapaxes(a_l, -1, -2), np.swapaxes(b_l, -1, -2))
    return out
