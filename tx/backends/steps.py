"""The jit-compiled functions of the training backend.

- `model_pass`: forward (optionally backward) over a padded batch whose rows belong to different
  adapters and use different losses; gradients of the summed loss w.r.t. the LoRA weights of all slots
  are added into the gradient sums (donated). A slot's weights are touched only by its own rows (each row
  gathers its adapter's weights), so gradients are isolated per adapter by construction.
- `optim_step`: AdamW on one slot. Parameters, gradient sums and Adam moments of that slot are sliced
  out with the slot index as a traced value (one compile serves every adapter), updated, and written
  back; hyperparameters are traced too, so changing them never recompiles. Adam moments exist per
  adapter and are shaped like one slot, so memory is O(adapters), and weight decay only sees this slot.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tx.models.sharding import put_global

from tx import losses
from tx.models.layers.lora import LoraA, LoraB

TRAINABLE = (LoraA, LoraB)
ADAPTER_AXIS = -3  # of every LoRA factor


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, LoRA factors of all slots, everything else)."""
    return nnx.split(model, TRAINABLE, ...)


def make_model_pass(
    graphdef: nnx.GraphDef,
    chunk_size: int,
    with_grad: bool,
    on_trace: Callable[[], None],
) -> Callable:
    """`(lora, frozen, grad_sum, batch) -> (grad_sum, target_logprobs [b, t], per_token_loss [b, t])`."""
    loss_names, keys = losses.names(), losses.config_keys()

    def summed_loss(lora, frozen, batch):
        model = nnx.merge(graphdef, lora, frozen)
        adapter_b = batch["adapter"]
        hidden_btd = model(batch["input_ids"], batch["attention_mask"], adapter_b,
                           positions_bt=batch["positions"], segment_ids_bt=batch["segment_ids"])
        tlp_bt = model.target_logprobs(hidden_btd, batch["targets"], adapter_b, chunk_size=chunk_size)
        inputs = {k: batch[k] for k in losses.INPUT_KEYS}
        loss_bt = losses.per_token_losses(tlp_bt, inputs, batch["loss_index"], batch["config"], loss_names, keys)
        loss_bt = jnp.where(batch["attention_mask"] > 0, loss_bt, 0.0)
        return jnp.sum(loss_bt), (tlp_bt, loss_bt)

    def run(lora, frozen, grad_sum, batch):
        on_trace()
        if not with_grad:
            _, (tlp_bt, loss_bt) = summed_loss(lora, frozen, batch)
            return grad_sum, tlp_bt, loss_bt
        (_, (tlp_bt, loss_bt)), grads = jax.value_and_grad(summed_loss, has_aux=True)(lora, frozen, batch)
        return jax.tree.map(jnp.add, grad_sum, grads), tlp_bt, loss_bt

    return jax.jit(run, donate_argnums=(2,) if with_grad else ())


def take_slot(tree: Any, slot: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, x.ndim + ADAPTER_AXIS, keepdims=False), tree)


def put_slot(tree: Any, values: Any, slot: jax.Array) -> Any:
    return jax.tree.map(
        lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), slot, x.ndim + ADAPTER_AXIS),
        tree,
        values,
    )


def adamw(hp: dict[str, jax.Array]) -> optax.GradientTransformation:
    """optax AdamW built from (possibly traced) hyperparameters; its state layout does not depend on them."""
    return optax.adamw(
        learning_rate=hp["learning_rate"], b1=hp["beta1"], b2=hp["beta2"], eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )


def init_opt_state(lora: nnx.State, slot: int, mesh: Mesh) -> optax.OptState:
    """Zero Adam state for one slot; scalars (the step count) replicated on the mesh so that the first
    and later optim_steps see identically placed inputs (no recompile)."""
    one = {k: 0.0 for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay")}
    state = adamw(one).init(take_slot(lora, jnp.int32(slot)))

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else put_global(np.asarray(x), NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


def make_optim_step(on_trace: Callable[[], None]) -> Callable:
    """`(lora, grad_sum, opt_state, slot, hp) -> (lora, grad_sum, opt_state, metrics)`; slot reset to zero."""

    def step(lora, grad_sum, opt_state, slot, hp):
        on_trace()
        params, grads = take_slot(lora, slot), take_slot(grad_sum, slot)
        grad_norm = optax.tree.norm(grads)
        clip = hp["grad_clip_norm"]
        clip_scale = jnp.where((clip > 0) & (grad_norm > clip), clip / jnp.maximum(grad_norm, 1e-30), 1.0)
        grads = jax.tree.map(lambda g: g * clip_scale, grads)
        updates, opt_state = adamw(hp).update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        lora = put_slot(lora, new_params, slot)
        grad_sum = put_slot(grad_sum, jax.tree.map(jnp.zeros_like, grads), slot)
        metrics = {
            "grad_norm": grad_norm,
            "grad_clip_scale": clip_scale,
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(new_params),
        }
        return lora, grad_sum, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1, 2))
