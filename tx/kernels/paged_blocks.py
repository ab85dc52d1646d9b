"""One block of paged attention's online softmax: gathering a block's pages, forming its products, folding it
into the running state. Shared by the row-by-row read (`paged_attention.blocked_paged_attention`) and the
shared-prefix read (`shared_prefix.prefix_state`), so that both run the same operations on a row's keys: a
row's state after its first blocks is the same bits whichever of the two read them.

State, per query: running max `m_bkgt`, running sum `l_bkgt` (float32 `[b, kv, g, t]`) and weighted values
`acc_btkgd` (float32). A fully masked block leaves a state with a real max bit-identical (its probabilities
are exactly 0, the correction exactly 1).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from tx.kernels.attention import _MASKED
from tx.kernels.platform import resolve
from tx.kernels.row_groups import group_count

BlockState = tuple[jax.Array, jax.Array, jax.Array]  # (m_bkgt, l_bkgt, acc_btkgd)
Products = tuple[Callable[[jax.Array, jax.Array], jax.Array], Callable[[jax.Array, jax.Array], jax.Array]]


def gather_pages(pool_lnpkd: jax.Array, layer, pages_bm: jax.Array) -> jax.Array:
    """`[b, m * page_size, kv, d]`: the tokens of pages `pages_bm` of `layer`, in table order (one indexing
    step: never `pool[layer]` first, a copy of the layer)."""
    b, m = pages_bm.shape
    _, _, page, kv, d = pool_lnpkd.shape
    return pool_lnpkd[layer, pages_bm].reshape(b, m * page, kv, d)


def _block_scores(q_btkgd: jax.Array, k_bskd: jax.Array) -> jax.Array:
    return jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd, preferred_element_type=jnp.float32)


def _block_values(p_bkgts: jax.Array, v_bskd: jax.Array) -> jax.Array:
    return jnp.einsum("bkgts,bskd->btkgd", p_bkgts, v_bskd, preferred_element_type=jnp.float32)


# Decode (t = 1) has two ways to form a block's products, chosen by `decode_products`. The gathered block
# `[b, s, kv, d]` has the kv heads inside the token axis, so a dot with (row, kv head) batch dimensions
# first transposes the whole block (a second copy of every key and value read).
# - "dot": every query head meets every kv head of the block as stored, `[b, s * kv, d]`, one batched
#   matmul, and a one-hot over kv heads keeps each head's own scores (kv x the score FLOPs, tiny next to the
#   block's bytes at one row); the masked terms are exact zeros, so the kept sums are unchanged.
# - "reduce": an elementwise product and a sum over the head dim (scores) or the block's tokens (values):
#   one loop fusion reading the block once, no wasted FLOPs. On CPU it is 1.5-1.8x faster than "dot" per
#   layer at 8-512 rows (micro-benchmark at bench_peer's shape, docs/performance.md), level at one row.


def _decode_scores_dot(q_btkgd: jax.Array, k_bskd: jax.Array) -> jax.Array:
    b, t, kv, g, d = q_btkgd.shape
    s = k_bskd.shape[1]
    all_bhn = jnp.einsum("bhd,bnd->bhn", q_btkgd.reshape(b, kv * g, d), k_bskd.reshape(b, s * kv, d),
                         preferred_element_type=jnp.float32)
    own_kk = jnp.eye(kv, dtype=jnp.float32)[:, None, None, :]  # [kv, 1, 1, kv']
    s_bkgs = jnp.sum(all_bhn.reshape(b, kv, g, s, kv) * own_kk, axis=-1)
    return s_bkgs[:, :, :, None, :]


def _decode_values_dot(p_bkgts: jax.Array, v_bskd: jax.Array) -> jax.Array:
    b, kv, g, t, s = p_bkgts.shape
    d = v_bskd.shape[-1]
    own_kk = jnp.eye(kv, dtype=p_bkgts.dtype)[:, None, None, :]
    p_bhn = (p_bkgts[:, :, :, 0, :, None] * own_kk).reshape(b, kv * g, s * kv)
    pv_bhd = jnp.einsum("bhn,bnd->bhd", p_bhn, v_bskd.reshape(b, s * kv, d), preferred_element_type=jnp.float32)
    return pv_bhd.reshape(b, 1, kv, g, d)


def _decode_scores_reduce(q_btkgd: jax.Array, k_bskd: jax.Array) -> jax.Array:
    s_bskg = jnp.sum(q_btkgd[:, :1] * k_bskd[:, :, :, None, :], axis=-1, dtype=jnp.float32)
    return jnp.transpose(s_bskg, (0, 2, 3, 1))[:, :, :, None, :]


def _decode_values_reduce(p_bkgts: jax.Array, v_bskd: jax.Array) -> jax.Array:
    p_bskg = jnp.transpose(p_bkgts[:, :, :, 0, :], (0, 3, 1, 2))
    pv_bkgd = jnp.sum(p_bskg[..., None] * v_bskd[:, :, :, None, :], axis=1, dtype=jnp.float32)
    return pv_bkgd[:, None]


DECODE_PRODUCTS: dict[str, Products] = {"dot": (_decode_scores_dot, _decode_values_dot),
                                        "reduce": (_decode_scores_reduce, _decode_values_reduce)}


def decode_products(rows: int, platform: str | None) -> str:
    """How decode forms a block's products for `rows` rows in a program for `platform`: "reduce" on CPU at
    two rows or more, "dot" otherwise (one row: level on CPU; GPUs: measured with "dot" only)."""
    return "reduce" if rows > 1 and resolve(platform) == "cpu" else "dot"


# On CPU, decode attention over more rows than this runs them in groups of at most this many rows in turn
# (`decode_row_groups`): a group's gathered block (64 rows x 32 tokens x 4 kv heads x 64 = 2 MB of keys at
# bench_peer's shape) is still in cache when its products read it, where 512 rows' (17 MB) come back from
# memory (docs/performance.md); None: all rows at once
DECODE_ROW_GROUP: int | None = 64


def decode_row_groups(rows: int, platform: str | None) -> int:
    """Into how many groups of consecutive rows decode attention over `rows` rows goes in a program for
    `platform` (`row_groups.group_count` of at most `DECODE_ROW_GROUP` rows): 1 (at once) off CPU, where it is
    not measured and the loops are the kernels'."""
    return group_count(rows, 1, DECODE_ROW_GROUP) if resolve(platform) == "cpu" else 1


def block_products(t: int, products: str) -> Products:
    """(scores, weighted values) for blocks of `t` queries a row: decode's `products` form at t = 1 (an
    unknown name refused), batched matmuls otherwise."""
    if products not in DECODE_PRODUCTS:
        raise ValueError(f"products={products!r} is not one of {', '.join(DECODE_PRODUCTS)}")
    return DECODE_PRODUCTS[products] if t == 1 else (_block_scores, _block_values)


def initial_state(b: int, kv: int, g: int, t: int, dv: int) -> BlockState:
    """The state before any key: max `_MASKED`, sum and weighted values 0."""
    return (jnp.full((b, kv, g, t), _MASKED, jnp.float32), jnp.zeros((b, kv, g, t), jnp.float32),
            jnp.zeros((b, t, kv, g, dv), jnp.float32))


def attend_block(state: BlockState, q_btkgd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                 mask_bts: jax.Array, scale: float, products: Products) -> BlockState:
    """`state` with one block of keys `k_bskd` / values `v_bskd` folded in, where `mask_bts` lets a query
    see a key."""
    m_bkgt, l_bkgt, acc_btkgd = state
    scores, weighted_values = products
    s_bkgts = scores(q_btkgd, k_bskd)
    s_bkgts = jnp.where(mask_bts[:, None, None], s_bkgts * scale, _MASKED)
    m_new = jnp.maximum(m_bkgt, s_bkgts.max(axis=-1))
    p_bkgts = jnp.exp(s_bkgts - m_new[..., None])
    corr_bkgt = jnp.exp(m_bkgt - m_new)
    l_new = l_bkgt * corr_bkgt + p_bkgts.sum(axis=-1)
    pv_btkgd = weighted_values(p_bkgts.astype(v_bskd.dtype), v_bskd)
    acc_new = acc_btkgd * jnp.moveaxis(corr_bkgt, -1, 1)[..., None] + pv_btkgd
    return m_new, l_new, acc_new
