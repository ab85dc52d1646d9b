"""Per-adapter LoRA matmuls, two ways, plus the routing of grouped (MoE) rows and the reference.

Every LoRA product runs in float32 whatever the model dtype: the input is cast up, the adapters are stored
in float32, and the rank-r intermediate stays float32 (as PEFT does; it is rank-sized, so cheap).

- `lora_delta_rows`: every batch row belongs to one adapter (training, prefill, decode). Each row's A
  and B are gathered (`[b, in, R]`, tiny next to the `[b, t, in]` activations) and applied with a batched
  matmul. FLOPs are `b * t * in * R * 2`, independent of how many adapters the batch mixes and of how
  many slots exist; no token permutation, and rows stay on their fsdp shard. Decode rows (one token, at
  least as many rows as slots) skip the gathers, which cost more than their FLOPs there: a one-hot over
  slots applies every slot's factors.
- `add_lora_head_delta`: the same product for an output as wide as the vocabulary, where a per-row B
  (`[b, R, vocab]`) or a separate delta would cost as much memory as the logits. `x A` is per row; B is
  applied for all slots at once through a one-hot over (slot, rank), added in place into the base logits
  a vocabulary block at a time, so memory does not grow with rows (decode: one dot, the logits' size).
- `make_routing`: the sort of rows by a group id (MoE: expert x present adapter) that the grouped
  matmuls of `tx.kernels.gmm` take.
- `lora_delta_reference`: gathers a weight matrix per token; memory O(tokens * in * R), the oracle.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """A permutation that sorts rows by group id, its inverse, and the size of each group."""

    sort_n: jax.Array  # int32 [n]: sorted position -> original row
    unsort_n: jax.Array  # int32 [n]: original row -> sorted position
    group_sizes_g: jax.Array  # int32 [g]


def make_routing(group_n: jax.Array, num_groups: int) -> Routing:
    """Stable sort of rows by group id; ties keep row order."""
    group_n = group_n.astype(jnp.int32)
    sort_n = jnp.argsort(group_n, stable=True).astype(jnp.int32)
    unsort_n = jnp.argsort(sort_n).astype(jnp.int32)
    sizes_g = jnp.bincount(group_n, length=num_groups).astype(jnp.int32)
    return Routing(sort_n, unsort_n, sizes_g)


def _one_hot_slots(b: int, t: int, slots: int) -> bool:
    """Whether rows apply every slot's factors (`_slot_rank_activations`): at one token per row and at least
    as many rows as slots, where copying all slots' A costs no more than gathering every row's."""
    return t == 1 and slots <= b


def _per_row(w_a: jax.Array, adapter_b: jax.Array) -> jax.Array:
    """`w_a[adapter_b]`, each row's slot of a per-slot weight; for one row a dynamic slice (batch-1 decode on
    CPU: with gathers, bench_peer's 32-token call at the 100M shape took 550 ms, with slices 495)."""
    if adapter_b.shape[0] == 1:
        return jax.lax.dynamic_slice_in_dim(w_a, adapter_b[0], 1, axis=0)
    return w_a[adapter_b]


def _rank_activations(x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array) -> jax.Array:
    """float32 `x_b A[a_b]` [b, t, R]; the per-row A is rank-sized."""
    a_bir = _per_row(lora_a_air, adapter_b).astype(jnp.float32)
    return jnp.einsum("bti,bir->btr", x_bti.astype(jnp.float32), a_bir)


def _slot_rank_activations(x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array,
                           scale_a: jax.Array) -> jax.Array:
    """float32 `[b, t, A*R]`: row b's `scale[a_b] * x_b A[a_b]` in its slot's R columns, exact zeros in the
    others. `x` meets every slot's A at once: no per-row gather, for `A`x the rank FLOPs (cheap at one
    token per row: decode)."""
    b, t, _ = x_bti.shape
    slots, _, rank = lora_a_air.shape
    h_btar = jnp.einsum("bti,air->btar", x_bti.astype(jnp.float32), lora_a_air.astype(jnp.float32))
    weight_ba = jnp.where(adapter_b[:, None] == jnp.arange(slots)[None, :], scale_a.astype(jnp.float32)[None], 0.0)
    return (h_btar * weight_ba[:, None, :, None]).reshape(b, t, slots * rank)


def lora_delta_rows(
    x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array, lora_b_aro: jax.Array, scale_a: jax.Array
) -> jax.Array:
    """`scale[a_b] * (x_b A[a_b]) B[a_b]` for every row b; float32 [b, t, o].

    Rows of one token (decode), at least as many as slots, apply every slot's factors through a one-hot
    over slots (`_slot_rank_activations`, then B viewed as `[A*R, o]`), which copies no weights; longer
    rows gather their own A and B (rank-sized per row, FLOPs independent of the slot count)."""
    b, t, _ = x_bti.shape
    slots, rank, out = lora_b_aro.shape
    if _one_hot_slots(b, t, slots):
        h_btq = _slot_rank_activations(x_bti, adapter_b, lora_a_air, scale_a)
        return jnp.einsum("btq,qo->bto", h_btq, lora_b_aro.astype(jnp.float32).reshape(slots * rank, out))
    h_btr = _rank_activations(x_bti, adapter_b, lora_a_air)
    b_bro = _per_row(lora_b_aro, adapter_b).astype(jnp.float32)
    y_bto = jnp.einsum("btr,bro->bto", h_btr, b_bro)
    return y_bto * _per_row(scale_a, adapter_b)[:, None, None].astype(jnp.float32)


HEAD_BLOCK = 1024  # vocabulary columns of the head delta added per step


def add_lora_head_delta(
    logits_bto: jax.Array,
    x_bti: jax.Array,
    adapter_b: jax.Array,
    lora_a_air: jax.Array,
    lora_b_aro: jax.Array,
    scale_a: jax.Array,
    block: int = HEAD_BLOCK,
) -> jax.Array:
    """`logits + lora_delta_rows(x, ...)` for a vocabulary-wide output (the LM head); float32 [b, t, o].

    `x A` is per row (rank-sized). Each token's scaled rank-r activations sit in one group's R columns of
    a `[tokens, G*R]` one-hot layout, multiplied by B viewed as `[G*R, o]`. With at least as many rows
    as slots the groups are the slots and B is used as stored (no gather; extra FLOPs
    `tokens * A * R * o`, A*R / hidden of the base head); with fewer rows (decode, sampling) the groups
    are the rows and B is gathered per row, `b * R * o` < `A * R * o`. The product is added into `logits`
    in place, `block` columns at a time (`_add_low_rank`), so no `[b, t, o]` delta exists either; except at
    one token per row (decode), where the delta is the logits' size and one dot replaces the loop's
    `o / block` small steps (kernel launches that dominate a decode step on a GPU)."""
    b, t, out = logits_bto.shape
    num_slots, rank, _ = lora_b_aro.shape
    if _one_hot_slots(b, t, num_slots):  # decode: one dot over every slot's B; the delta is the logits' size
        h_nq = _slot_rank_activations(x_bti, adapter_b, lora_a_air, scale_a).reshape(b * t, num_slots * rank)
        delta_no = jnp.dot(h_nq, lora_b_aro.astype(jnp.float32).reshape(num_slots * rank, out))
        return logits_bto.astype(jnp.float32) + delta_no.reshape(b, t, out)
    h_btr = _rank_activations(x_bti, adapter_b, lora_a_air) * _per_row(scale_a, adapter_b)[:, None, None].astype(
        jnp.float32)
    if t == 1:  # decode with fewer rows than slots: the delta is the logits' size, so one dot over row-own B
        delta_bo = jnp.einsum("br,bro->bo", h_btr[:, 0], _per_row(lora_b_aro, adapter_b).astype(jnp.float32))
        return logits_bto.astype(jnp.float32) + delta_bo[:, None]
    if b >= num_slots:
        group_b, b_gro = adapter_b, lora_b_aro
    else:
        group_b, b_gro = jnp.arange(b), _per_row(lora_b_aro, adapter_b)
    groups = b_gro.shape[0]
    onehot_bg = (group_b[:, None] == jnp.arange(groups)[None, :]).astype(jnp.float32)
    h_nq = (h_btr[:, :, None, :] * onehot_bg[:, None, :, None]).reshape(b * t, groups * rank)
    b_qo = b_gro.astype(jnp.float32).reshape(groups * rank, out)
    logits_no = _add_low_rank(logits_bto.astype(jnp.float32).reshape(b * t, out), h_nq, b_qo, min(block, out))
    return logits_no.reshape(b, t, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_low_rank(logits_no: jax.Array, h_nq: jax.Array, b_qo: jax.Array, block: int) -> jax.Array:
    """`logits + h B`, added in place `block` output columns at a time (a fori_loop over a carried buffer)."""

    def add_block(start, size, logits):
        current = jax.lax.dynamic_slice_in_dim(logits, start, size, axis=1)
        delta = jnp.dot(h_nq, jax.lax.dynamic_slice_in_dim(b_qo, start, size, axis=1))
        return jax.lax.dynamic_update_slice_in_dim(logits, current + delta, start, axis=1)

    out = logits_no.shape[1]
    full = out // block
    logits_no = jax.lax.fori_loop(0, full, lambda j, lg: add_block(j * block, block, lg), logits_no)
    if out > full * block:
        logits_no = add_block(full * block, out - full * block, logits_no)
    return logits_no


def _add_low_rank_fwd(logits_no, h_nq, b_qo, block):
    return _add_low_rank(logits_no, h_nq, b_qo, block), (h_nq, b_qo)


def _add_low_rank_bwd(block, residuals, g_no):
    # Written out: autodiff of the in-place loop would add a full [n, o] zero-padded block per step.
    h_nq, b_qo = residuals
    contract_out = (((1,), (1,)), ((), ()))
    contract_tokens = (((0,), (0,)), ((), ()))
    return g_no, jax.lax.dot_general(g_no, b_qo, contract_out), jax.lax.dot_general(h_nq, g_no, contract_tokens)


_add_low_rank.defvjp(_add_low_rank_fwd, _add_low_rank_bwd)


def lora_delta_reference(
    x_ni: jax.Array, group_n: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, scale_n: jax.Array
) -> jax.Array:
    """`scale_n * (x_n A[g_n]) B[g_n]` per row, by gathering each row's own weights; float32 [n, o]."""
    x = x_ni.astype(jnp.float32)
    h_nr = jnp.einsum("ni,nir->nr", x, lora_a_gir[group_n].astype(jnp.float32))
    y_no = jnp.einsum("nr,nro->no", h_nr, lora_b_gro[group_n].astype(jnp.float32))
    return y_no * scale_n[:, None]
