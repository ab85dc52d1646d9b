"""Grouped (per-adapter) LoRA matmuls.

Every token carries a group id (its adapter, or adapter x expert for MoE). Tokens are sorted by group
once, and each LoRA factor is applied with one `jax.lax.ragged_dot`: a grouped GEMM whose cost depends on
the number of tokens, not on how many distinct adapters the batch holds. `lora_delta_reference` computes
the same thing by gathering a weight matrix per token; it is the oracle the tests compare against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """A permutation that sorts tokens by group id, its inverse, and the size of each group."""

    sort_n: jax.Array  # int32 [n]: sorted position -> original token
    unsort_n: jax.Array  # int32 [n]: original token -> sorted position
    group_sizes_g: jax.Array  # int32 [g]


def make_routing(group_n: jax.Array, num_groups: int) -> Routing:
    """Stable sort of tokens by group id; ties keep token order."""
    group_n = group_n.astype(jnp.int32)
    sort_n = jnp.argsort(group_n, stable=True).astype(jnp.int32)
    unsort_n = jnp.argsort(sort_n).astype(jnp.int32)
    sizes_g = jnp.bincount(group_n, length=num_groups).astype(jnp.int32)
    return Routing(sort_n, unsort_n, sizes_g)


def lora_delta_sorted(
    x_sorted_ni: jax.Array,
    lora_a_gir: jax.Array,
    lora_b_gro: jax.Array,
    group_sizes_g: jax.Array,
) -> jax.Array:
    """`(x A_g) B_g` for tokens already sorted by group; returns float32 [n, o] in sorted order."""
    dtype = x_sorted_ni.dtype
    h_nr = jax.lax.ragged_dot(
        x_sorted_ni, lora_a_gir.astype(dtype), group_sizes_g, preferred_element_type=jnp.float32
    )
    return jax.lax.ragged_dot(
        h_nr.astype(dtype), lora_b_gro.astype(dtype), group_sizes_g, preferred_element_type=jnp.float32
    )


def lora_delta(
    x_ni: jax.Array,
    routing: Routing,
    lora_a_gir: jax.Array,
    lora_b_gro: jax.Array,
    scale_n: jax.Array,
) -> jax.Array:
    """Per-token LoRA delta `scale * (x A_g) B_g` in original token order, float32 [n, o]."""
    y_sorted_no = lora_delta_sorted(x_ni[routing.sort_n], lora_a_gir, lora_b_gro, routing.group_sizes_g)
    return y_sorted_no[routing.unsort_n] * scale_n[:, None].astype(jnp.float32)


def lora_delta_reference(
    x_ni: jax.Array, group_n: jax.Array, lora_a_gir: jax.Array, lora_b_gro: jax.Array, scale_n: jax.Array
) -> jax.Array:
    """Same result as `lora_delta`, by gathering each token's own A and B (memory O(n * i * r))."""
    x = x_ni.astype(jnp.float32)
    h_nr = jnp.einsum("ni,nir->nr", x, lora_a_gir[group_n].astype(jnp.float32))
    y_no = jnp.einsum("nr,nro->no", h_nr, lora_b_gro[group_n].astype(jnp.float32))
    return y_no * scale_n[:, None]
