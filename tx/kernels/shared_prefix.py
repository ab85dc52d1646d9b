"""Decode attention's shared-prefix (cascade) part: the pages several rows share, read once for all of them.

The samples of one prompt (an RL group) hold the same prompt pages in their tables. Read row by row, each
page is gathered and multiplied once per row; here the rows are laid out in segments of `c` rows (a
permutation of the batch the host picks, `SharedPrefix.order_s`), each segment has one table of pages its
rows share (`table_nw`), and one product per segment and block scores all its rows' queries against those
keys: a `[c * g, d] x [d, block]` matmul per kv head instead of `c` one-row products, and the block's keys
and values gathered once instead of `c` times.

The result is each row's online-softmax state (running max, sum and weighted values, as
`paged_attention.blocked_paged_attention` keeps it) over its first `len_s` keys; the row's own blocked loop
continues from it at key `len_s` (a multiple of the block, so no block is read twice). A row with `len_s`
0 (no segment shares its pages, or a filler of a segment) leaves the state at its start: max `_MASKED`, sum
and values 0, exactly what the loop starts from without a prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx.kernels.attention import _MASKED


class SharedPrefix(NamedTuple):
    """Which rows read which shared pages (`n` segments of `c = b / n` rows each; every index is local to the
    device's rows where the batch is split over devices)."""

    order_s: jax.Array  # int32 [b]: the row at each place of the segment layout (a permutation)
    place_s: jax.Array  # int32 [b]: each row's place in it (the inverse permutation)
    table_nw: jax.Array  # int32 [n, w]: each segment's shared pages, in table order (padded with the trash page)
    len_s: jax.Array  # int32 [b]: keys each row reads from its segment's pages (a multiple of kv_block; 0: none)


def prefix_state(q_bkgd: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, prefix: SharedPrefix,
                 scale: float, kv_block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode query per row, `q_bkgd` `[b, kv, g, d]`, over the keys `0 .. len_s - 1` of its segment's
    pages: the online-softmax state (max `[b, kv, g]`, sum `[b, kv, g]`, weighted values `[b, kv, g, d]`,
    float32), blocks of `kv_block` tokens in a loop of as many blocks as the longest `len_s` spans."""
    b, kv, g, d = q_bkgd.shape
    n, w = prefix.table_nw.shape
    c = b // n
    page = k_pool.shape[2]
    pages_per_block = kv_block // page
    table_nw = jnp.pad(prefix.table_nw, ((0, 0), (0, -w % pages_per_block)))
    q_nckgd = q_bkgd[prefix.order_s].reshape(n, c, kv, g, d)
    len_nc = prefix.len_s[prefix.order_s].reshape(n, c)

    def body(j, state):
        m_nkcg, l_nkcg, acc_nckgd = state
        pages_nm = jax.lax.dynamic_slice_in_dim(table_nw, j * pages_per_block, pages_per_block, axis=1)
        k_nskd = k_pool[layer, pages_nm].reshape(n, kv_block, kv, -1)
        v_nskd = v_pool[layer, pages_nm].reshape(n, kv_block, kv, -1)
        seen_ncs = (j * kv_block + jnp.arange(kv_block))[None, None, :] < len_nc[:, :, None]
        seen_nkcgs = seen_ncs[:, None, :, None, :]
        s_nkcgs = jnp.einsum("nckgd,nskd->nkcgs", q_nckgd, k_nskd, preferred_element_type=jnp.float32)
        s_nkcgs = jnp.where(seen_nkcgs, s_nkcgs * scale, _MASKED)
        m_new = jnp.maximum(m_nkcg, s_nkcgs.max(axis=-1))
        # a row that reads no key of this block keeps its state: its terms are zeros, not exp(0)
        p_nkcgs = jnp.where(seen_nkcgs, jnp.exp(s_nkcgs - m_new[..., None]), 0.0)
        corr_nkcg = jnp.exp(m_nkcg - m_new)
        pv_nckgd = jnp.einsum("nkcgs,nskd->nckgd", p_nkcgs.astype(v_nskd.dtype), v_nskd,
                              preferred_element_type=jnp.float32)
        acc_new = acc_nckgd * jnp.transpose(corr_nkcg, (0, 2, 1, 3))[..., None] + pv_nckgd
        return m_new, l_nkcg * corr_nkcg + p_nkcgs.sum(axis=-1), acc_new

    init = (jnp.full((n, kv, c, g), _MASKED, jnp.float32), jnp.zeros((n, kv, c, g), jnp.float32),
            jnp.zeros((n, c, kv, g, q_bkgd.shape[-1]), jnp.float32))
    blocks = jnp.max(prefix.len_s) // kv_block
    m_nkcg, l_nkcg, acc_nckgd = jax.lax.fori_loop(0, blocks, body, init)

    def by_row(x_nckg):  # segment layout -> the batch's rows
        return x_nckg.reshape(b, *x_nckg.shape[2:])[prefix.place_s]

    return (by_row(jnp.transpose(m_nkcg, (0, 2, 1, 3))), by_row(jnp.transpose(l_nkcg, (0, 2, 1, 3))),
            by_row(acc_nckgd))
