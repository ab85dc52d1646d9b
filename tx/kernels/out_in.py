"""Products with a weight stored `[out, in]`: the kept decode copies' layout on CPU (`tx.sampling.layer_copies`).

At a few rows XLA's CPU matmul reads such a weight at about half the rate a one-row product reads it (its
GEMM packs the weight before multiplying). Written as a multiply and a sum over `in`, with the output
`[out, rows]`, the product is one reduction (YNNPACK's, on jax 0.10-0.12) that reads each weight row once
and meets every input row with it while it sits in cache. Chains of distinct weights at bench_peer's ~100M
shape, this 2-core CPU (docs/performance.md): 1.3-2.1x the matmul on the same layout at 2-16 rows, 1.3-1.5x
at 32, about level from 64 rows, where the matmul is compute-bound. Whole decode calls: 1.16x at 8 rows
against the previous copies (attention projections `[in, out]`), 1.25x at 16, 1.10-1.14x at 32 and level
at 64 against the matmul on these copies, so `out_in_product` takes the sum for `REDUCE_ROWS` rows only.

Rounding: the sum's order depends on the row count, the matmul's does not. A row of a call of 2-32 rows
agrees with itself in a call of another row count to float32 rounding (~1e-6 relative per product), as
a row alone (one-row programs) already did with a batch; calls of 33 rows or more keep the matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REDUCE_ROWS = (2, 32)  # row counts (batch x tokens) whose products are a multiply and a sum


def out_in_product(x_bti: jax.Array, w_oi: jax.Array) -> jax.Array:
    """float32 `[b, t, out]`: `x_bti` times the weight `w_oi` (`[out, in]`), in float32 whatever the dtypes."""
    b, t, i = x_bti.shape
    rows = b * t
    if not REDUCE_ROWS[0] <= rows <= REDUCE_ROWS[1]:
        return jnp.einsum("bti,oi->bto", x_bti, w_oi, preferred_element_type=jnp.float32)
    # the barrier keeps the broadcasts inside the reduction: without it XLA shares one broadcast input
    # between sibling products (q/k/v, gate/up read the same x) and writes it out, `[out, rows, in]`,
    # which made a decode step 1.8x slower
    x_ni, w_oi = jax.lax.optimization_barrier((x_bti.reshape(rows, i), w_oi))
    prod_oni = w_oi[:, None, :].astype(jnp.float32) * x_ni[None, :, :].astype(jnp.float32)
    return jnp.sum(prod_oni, axis=-1).T.reshape(b, t, -1)
