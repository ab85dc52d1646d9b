"""The jit-compiled functions of the training backend.

- `model_pass`: forward (optionally backward) over a padded batch whose rows belong to different
  adapters and use different losses; gradients of the summed loss w.r.t. the LoRA weights of all slots
  go into a per-call temporary (donated between micro-batches), which `commit_grads` adds into the
  gradient sums in place once the whole call succeeded. A slot's weights are touched only by its own rows
  (each row gathers its adapter's weights), so gradients are isolated per adapter by construction.
- `optim_step`: AdamW on one slot. Parameters, gradient sums and Adam moments of that slot are sliced
  out with the slot index as a traced value (one compile serves every adapter), updated, and written
  back only if everything came out finite; hyperparameters are traced too, so changing them never
  recompiles. Adam moments exist per
  adapter and are shaped like one slot, so memory is O(adapters), and weight decay only sees this slot.
"""

from __future__ import annotations

from functools import partial
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
    mode: str,
    on_trace: Callable[[], None],
    grad_dtype: Any = None,
    extra_keys: tuple[str, ...] = (),
    aux: tuple[str, ...] = (),
    tempered: bool = False,
    with_logprobs: bool = True,
    head_lora: bool = True,
    loss_names: tuple[str, ...] | None = None,
) -> Callable:
    """The jitted pass of one micro-batch, by `mode` (gradients cast to `grad_dtype` when given):

    - "forward":    `(lora, frozen, batch) -> (target_logprobs [b, t, K], per_token_loss [b, t], aux)`
    - "grads":      `(lora, frozen, batch) -> (grads, tlp, loss, aux)`: the first micro-batch of a call
    - "accumulate": `(lora, frozen, acc, batch) -> (acc + grads, tlp, loss, aux)`, `acc` donated

    `aux` holds the per-position quantities [b, t] some row's loss reads (`losses.AUX_INPUTS`), each computed only
    when named in `aux`: "entropy" (of each position's next-token distribution) and "values" (the row's adapter's
    value head on the final hidden states). They are loss inputs (with their gradients) and outputs.
    `tempered`: log-probs and entropy are of softmax(logits / batch["temperature"][row]) (compiled apart, so
    untempered passes pay nothing). `with_logprobs=False` (no row's loss reads them, no entropy): the LM head is
    skipped and target_logprobs are zeros. `head_lora=False` (no row's adapter trains the LM head: its LoRA
    scale is 0, so its delta and gradients are exactly zero): the head's LoRA delta is not computed (the
    per-block in-place add over the vocabulary and its backward: 3.12 -> 2.72 s per 8x128 pass of a 100M
    model on CPU).

    `loss_names` are the losses the pass evaluates (the batch's "loss_index" points into them; default: every
    registered one); `extra_keys` the extra per-token loss inputs the batch carries
    (`losses.extra_input_keys(loss_names)`).
    None of them reads the gradient sums: a call accumulates into its own temporary and the backend
    commits it with `commit_grads` once every micro-batch has succeeded (all-or-nothing per call)."""
    loss_names = losses.names() if loss_names is None else loss_names
    keys = losses.config_keys(loss_names)

    def summed_loss(lora, frozen, batch):
        model = nnx.merge(graphdef, lora, frozen)
        adapter_b = batch["adapter"]
        hidden_btd = model(batch["input_ids"], batch["attention_mask"], adapter_b,
                           positions_bt=batch["positions"], segment_ids_bt=batch["segment_ids"])
        # targets [b, t, K]: the extra cost of K > 1 is a gather of K values per position of each chunk
        inputs = {k: batch[k] for k in losses.INPUT_KEYS + extra_keys}
        aux_bt = {}
        temperature_b = batch["temperature"] if tempered else None
        head_adapter_b = adapter_b if head_lora else None
        if not with_logprobs and "entropy" not in aux:  # e.g. a critic's pass: V needs no vocabulary projection
            tlp_bt = jnp.zeros(batch["targets"].shape, jnp.float32)
        elif "entropy" in aux:
            tlp_bt, aux_bt["entropy"] = model.target_logprobs(hidden_btd, batch["targets"], head_adapter_b,
                                                              chunk_size=chunk_size, with_entropy=True,
                                                              temperature_b=temperature_b)
        else:
            tlp_bt = model.target_logprobs(hidden_btd, batch["targets"], head_adapter_b, chunk_size=chunk_size,
                                           temperature_b=temperature_b)
        if "values" in aux:
            aux_bt["values"] = model.values(hidden_btd, adapter_b)
        loss_bt = losses.per_token_losses(tlp_bt, inputs | aux_bt, batch["loss_index"], batch["config"], loss_names,
                                          keys)
        loss_bt = jnp.where(batch["attention_mask"] > 0, loss_bt, 0.0)
        return jnp.sum(loss_bt), (tlp_bt, loss_bt, aux_bt)

    def forward(lora, frozen, batch):
        on_trace()
        _, outputs = summed_loss(lora, frozen, batch)
        return outputs

    def grads(lora, frozen, batch):
        on_trace()
        (_, outputs), g = jax.value_and_grad(summed_loss, has_aux=True)(lora, frozen, batch)
        if grad_dtype is not None:
            g = jax.tree.map(lambda x: x.astype(grad_dtype), g)
        return g, *outputs

    def accumulate(lora, frozen, acc, batch):
        g, *outputs = grads(lora, frozen, batch)
        return jax.tree.map(jnp.add, acc, g), *outputs

    if mode == "forward":
        return jax.jit(forward)
    if mode == "grads":
        return jax.jit(grads)
    if mode == "accumulate":
        return jax.jit(accumulate, donate_argnums=(2,))
    raise ValueError(f"model pass mode {mode!r} is not one of forward, grads, accumulate")


def _slot_mask(x: jax.Array, ok_s: jax.Array) -> jax.Array:
    """`ok_s` [slots] broadcast against `x` along its adapter axis."""
    shape = [1] * x.ndim
    shape[x.ndim + ADAPTER_AXIS] = ok_s.shape[0]
    return ok_s.reshape(shape)


def _finite_per_slot(tree: Any) -> jax.Array:
    """[slots] bool: every value of that slot, over all leaves, is finite."""
    def one(x):
        axes = tuple(a for a in range(x.ndim) if a != x.ndim + ADAPTER_AXIS)
        return jnp.all(jnp.isfinite(x), axis=axes)

    return jnp.all(jnp.stack(jax.tree.leaves(jax.tree.map(one, tree))), axis=0)


@partial(jax.jit, donate_argnums=(0,))
def commit_grads(grad_sum: Any, acc: Any, allowed_s: jax.Array) -> tuple[Any, jax.Array]:
    """Add a call's gradients `acc` into `grad_sum` for the slots that are `allowed_s` and whose new sums
    are finite; other slots keep their old sums bit for bit. Returns (grad_sum, finite_s). `grad_sum` is
    donated (updated in place); the caller drops `acc` right after."""
    new = jax.tree.map(jnp.add, grad_sum, acc)
    finite_s = _finite_per_slot(new)
    ok_s = allowed_s & finite_s
    return jax.tree.map(lambda n, o: jnp.where(_slot_mask(n, ok_s), n, o), new, grad_sum), finite_s


def _zero_slot(tree: Any, slot: jax.Array) -> Any:
    """`tree` with adapter `slot` zeroed; jitted with `tree` donated, so it is updated in place."""
    return jax.tree.map(lambda x: jnp.where(_slot_mask(x, jnp.arange(x.shape[ADAPTER_AXIS]) == slot), 0, x), tree)


zero_slot = jax.jit(_zero_slot, donate_argnums=(0,))


def take_slot(tree: Any, slot: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, x.ndim + ADAPTER_AXIS, keepdims=False), tree)


def _put_slot(tree: Any, values: Any, slot: jax.Array) -> Any:
    return jax.tree.map(
        lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), slot, x.ndim + ADAPTER_AXIS),
        tree,
        values,
    )


# Eager callers write one slot in place: `tree` is donated, so no second copy of all slots is made.
put_slot = jax.jit(_put_slot, donate_argnums=(0,))


def adamw(hp: dict[str, jax.Array]) -> optax.GradientTransformation:
    """optax AdamW built from (possibly traced) hyperparameters; its state layout does not depend on them."""
    return optax.adamw(
        learning_rate=hp["learning_rate"], b1=hp["beta1"], b2=hp["beta2"], eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating value of `tree` is finite (a scalar bool)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                              if jnp.issubdtype(x.dtype, jnp.floating)]))


def clip_metrics(grads: Any, hp: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The gradients' norm and the factor that clips them to `hp["grad_clip_norm"]` (1 when below it or when
    it is 0): both training modes clip the same way. Callers scale the gradients themselves, where the
    product is consumed (full training recomputes it inside its commit branch rather than keeping a copy)."""
    grad_norm = optax.tree.norm(grads)
    clip = hp["grad_clip_norm"]
    clip_scale = jnp.where((clip > 0) & (grad_norm > clip), clip / jnp.maximum(grad_norm, 1e-30), 1.0)
    return {"grad_norm": grad_norm, "grad_clip_scale": clip_scale}


def init_adamw_state(params: Any, mesh: Mesh) -> optax.OptState:
    """Zero AdamW state for `params`: moments placed like them (zeros_like keeps a committed array's sharding),
    scalars (the step count) replicated on the mesh so that the first and later optim_steps see identically
    placed inputs (no recompile)."""
    one = {k: 0.0 for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay")}
    state = adamw(one).init(params)

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else put_global(np.asarray(x), NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


def init_opt_state(lora: nnx.State, slot: int, mesh: Mesh) -> optax.OptState:
    """Zero Adam state for one slot (shaped like one slot's LoRA factors)."""
    return init_adamw_state(take_slot(lora, jnp.int32(slot)), mesh)


def make_optim_step(on_trace: Callable[[], None]) -> Callable:
    """`(lora, grad_sum, opt_state, slot, hp) -> (lora, grad_sum, opt_state, metrics, ok)`.

    `ok` says the new weights, Adam moments and metrics are all finite. Only then is the step committed
    (weights and moments written, the slot's gradient sums zeroed); otherwise every output equals its
    input bit for bit, so a refused step can be retried, e.g. with a smaller learning rate."""

    def step(lora, grad_sum, opt_state, slot, hp):
        on_trace()
        params, grads = take_slot(lora, slot), take_slot(grad_sum, slot)
        metrics = clip_metrics(grads, hp)
        clipped = jax.tree.map(lambda g: g * metrics["grad_clip_scale"], grads)
        updates, new_state = adamw(hp).update(clipped, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics |= {"update_norm": optax.tree.norm(updates), "param_norm": optax.tree.norm(new_params)}
        ok = all_finite((new_params, new_state, metrics))
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        lora = _put_slot(lora, jax.tree.map(keep, new_params, params), slot)
        grad_sum = _put_slot(grad_sum, jax.tree.map(lambda g: jnp.where(ok, jnp.zeros_like(g), g), grads), slot)
        opt_state = jax.tree.map(keep, new_state, opt_state)
        return lora, grad_sum, opt_state, metrics, ok

    return jax.jit(step, donate_argnums=(0, 1, 2))
