"""Grouped-query attention with an explicit boolean mask (XLA reference implementation).

Scores, softmax and the mask are computed in float32 whatever the input dtype. Masked positions get a
large finite negative score, so a row with no visible key (a pure padding row) yields finite garbage that
the caller ignores, never NaN that would poison gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


def causal_mask(attention_mask_bt: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """bool [b, t, s]: query t sees key s if s <= t, key s is not padding, and (packing) same segment."""
    t = attention_mask_bt.shape[1]
    causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
    mask_bts = causal_ts[None] & attention_mask_bt.astype(bool)[:, None, :]
    if segment_ids_bt is not None:
        mask_bts &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return mask_bts


def attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array, scale: float
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with h query heads sharing k kv heads; returns [b, t, h, d]."""
    b, t, h, d = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    q_btkgd = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd, preferred_element_type=jnp.float32)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts * scale, _MASKED)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1)
    out_btkgd = jnp.einsum(
        "bkgts,bskd->btkgd", probs_bkgts.astype(v_bskd.dtype), v_bskd, preferred_element_type=jnp.float32
    )
    return out_btkgd.reshape(b, t, h, d).astype(q_bthd.dtype)
