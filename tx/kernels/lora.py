"""Per-adapter LoRA matmuls, two ways, plus the reference both are tested against.

- `lora_delta_rows`: every batch row belongs to one adapter (training, prefill, decode). Each row's A
  and B are gathered (`[b, in, R]`, tiny next to the `[b, t, in]` activations) and applied with a batched
  matmul. FLOPs are `b * t * in * R * 2`, independent of how many adapters the batch mixes and of how
  many slots exist; no token permutation, and rows stay on their fsdp shard.
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


def lora_delta_rows(
    x_bti: jax.Array, adapter_b: jax.Array, lora_a_air: jax.Array, lora_b_aro: jax.Array, scale_a: jax.Array
) -> jax.Array:
    """`scale[a_b] * (x_b A[a_b]) B[a_b]` for every row b; float32 [b, t, o]."""
    dtype = x_bti.dtype
    a_bir = lora_a_air[adapter_b].astype(dtype)
    b_bro = lora_b_aro[adapter_b].astype(dtype)
    h_btr = jnp.einsum("bti,bir->btr", x_bti, a_bir, preferred_element_type=jnp.float32)
    y_bto = jnp.einsum("btr,bro->bto", h_btr.astype(dtype), b_bro, preferred_element_type=jnp.float32)
    return y_bto * scale_a[adapter_b][:, None, None].astype(jnp.float32)


def lora_delta_grouped(
    x_sorted_ni: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, group_sizes_g: jax.Array
) -> jax.Array:
    """`(x A_g) B_g` for rows already sorted by group; unscaled float32 [n, o] in sorted order."""
    dtype = x_sorted_ni.dtype
    h_nr = jax.lax.ragged_dot(
        x_sorted_ni, lora_a_gir.astype(dtype), group_sizes_g, preferred_element_type=jnp.float32
    )
    return jax.lax.ragged_dot(
        h_nr.astype(dtype), lora_b_gro.astype(dtype), group_sizes_g, preferred_element_type=jnp.float32
    )


def lora_delta_reference(
    x_ni: jax.Array, group_n: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, scale_n: jax.Array
) -> jax.Array:
    """`scale_n * (x_n A[g_n]) B[g_n]` per row, by gathering each row's own weights; float32 [n, o]."""
    x = x_ni.astype(jnp.float32)
    h_nr = jnp.einsum("ni,nir->nr", x, lora_a_gir[group_n].astype(jnp.float32))
    y_no = jnp.einsum("nr,nro->no", h_nr, lora_b_gro[group_n].astype(jnp.float32))
    return y_no * scale_n[:, None]
