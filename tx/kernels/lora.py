"""Per-adapter LoRA matmuls, three ways, plus the reference they are tested against.

Every LoRA product runs in float32 whatever the model dtype: the input is cast up, the adapters are stored
in float32, and the rank-r intermediate stays float32 (as PEFT does; it is rank-sized, so cheap).

- `lora_delta_rows`: every batch row belongs to one adapter (training, prefill, decode). Each row's A
  and B are gathered (`[b, in, R]`, tiny next to the `[b, t, in]` activations) and applied with a batched
  matmul. FLOPs are `b * t * in * R * 2`, independent of how many adapters the batch mixes and of how
  many slots exist; no token permutation, and rows stay on their fsdp shard.
- `add_lora_head_delta`: the same product for an output as wide as the vocabulary, where a per-row B
  (`[b, R, vocab]`) or a separate delta would cost as much memory as the logits. `x A` is per row; B is
  applied for all slots at once through a one-hot over (slot, rank), a vocabulary block at a time, added
  in place into the base logits, so memory does not grow with rows.
- `lora_delta_grouped`: rows already sorted by a group id (MoE: expert x adapter), applied with
  `jax.lax.ragged_dot`, a grouped GEMM on TPU. (XLA's CPU lowering of ragged_dot loops over groups.)
- `lora_delta_reference`: gathers a weight matrix per token; memory O(tokens * in * R), the oracle.
"""

from __future__ import annotations

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


def _rank_activations(x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array) -> jax.Array:
    """float32 `x_b A[a_b]` [b, t, R]; the per-row A is rank-sized."""
    a_bir = lora_a_air[adapter_b].astype(jnp.float32)
    return jnp.einsum("bti,bir->btr", x_bti.astype(jnp.float32), a_bir)


def lora_delta_rows(
    x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array, lora_b_aro: jax.Array, scale_a: jax.Array
) -> jax.Array:
    """`scale[a_b] * (x_b A[a_b]) B[a_b]` for every row b; float32 [b, t, o]."""
    h_btr = _rank_activations(x_bti, adapter_b, lora_a_air)
    b_bro = lora_b_aro[adapter_b].astype(jnp.float32)
    y_bto = jnp.einsum("btr,bro->bto", h_btr, b_bro)
    return y_bto * scale_a[adapter_b][:, None, None].astype(jnp.float32)


HEAD_BLOCK = 1024  # vocab columns of the head delta added per step


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

    `x A` is per row (rank-sized). B is applied `block` output columns at a time, each block added in place
    into `logits`: neither a per-row B (`[b, R, vocab]`) nor a full `[b, t, vocab]` delta ever exists, so
    the extra memory is rank- or block-sized, independent of the vocabulary's width times the rows.
    With at least as many rows as slots, each row's rank-r activations sit in its slot's columns of a
    `[tokens, A*R]` one-hot layout, multiplied by all of B's block viewed as `[A*R, block]` (no gather;
    extra FLOPs `tokens * A * R * o`, i.e. A*R / hidden of the base head). With fewer rows than slots
    (decode, sampling) each row's B block is gathered instead (`b * R * block`), at the minimal FLOPs."""
    b, t, out = logits_bto.shape
    num_slots, rank, _ = lora_b_aro.shape
    h_btr = _rank_activations(x_bti, adapter_b, lora_a_air) * scale_a[adapter_b][:, None, None].astype(jnp.float32)
    logits_bto = logits_bto.astype(jnp.float32)
    if b >= num_slots:
        onehot_ba = (adapter_b[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)
        h_btq = (h_btr[:, :, None, :] * onehot_ba[:, None, :, None]).reshape(b, t, num_slots * rank)
        b_qo = lora_b_aro.astype(jnp.float32).reshape(num_slots * rank, out)

        def delta(start, size):
            return jnp.dot(h_btq, jax.lax.dynamic_slice_in_dim(b_qo, start, size, axis=1))
    else:

        def delta(start, size):
            b_bro = jax.lax.dynamic_slice_in_dim(lora_b_aro, start, size, axis=2)[adapter_b]
            return jnp.einsum("btr,bro->bto", h_btr, b_bro.astype(jnp.float32))

    def add_block(start, size, logits):
        current = jax.lax.dynamic_slice_in_dim(logits, start, size, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(logits, current + delta(start, size), start, axis=2)

    block = min(block, out)
    full = out // block
    logits_bto = jax.lax.fori_loop(0, full, lambda j, lg: add_block(j * block, block, lg), logits_bto)
    if out > full * block:
        logits_bto = add_block(full * block, out - full * block, logits_bto)
    return logits_bto


def lora_delta_grouped(
    x_sorted_ni: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, group_sizes_g: jax.Array
) -> jax.Array:
    """`(x A_g) B_g` for rows already sorted by group; unscaled float32 [n, o] in sorted order."""
    f32 = jnp.float32
    h_nr = jax.lax.ragged_dot(x_sorted_ni.astype(f32), lora_a_gir.astype(f32), group_sizes_g)
    return jax.lax.ragged_dot(h_nr, lora_b_gro.astype(f32), group_sizes_g)


def lora_delta_reference(
    x_ni: jax.Array, group_n: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, scale_n: jax.Array
) -> jax.Array:
    """`scale_n * (x_n A[g_n]) B[g_n]` per row, by gathering each row's own weights; float32 [n, o]."""
    x = x_ni.astype(jnp.float32)
    h_nr = jnp.einsum("ni,nir->nr", x, lora_a_gir[group_n].astype(jnp.float32))
    y_no = jnp.einsum("nr,nro->no", h_nr, lora_b_gro[group_n].astype(jnp.float32))
    return y_no * scale_n[:, None]
