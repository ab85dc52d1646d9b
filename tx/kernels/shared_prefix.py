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
    float32), blocks of `kv_block` tokens in a loop of as many blocks as the longest `len_s` spans. Inside
    the loop a segment's queries are `[kv, c * g, d]` (the state likewise): the products' batch dims lead,
    so only the gathered block is transposed for them."""
    b, kv, g, d = q_bkgd.shape
    n, w = prefix.table_nw.shape
    c = b // n
    page = k_pool.shape[2]
    pages_per_block = kv_block // page
    table_nw = jnp.pad(prefix.table_nw, ((0, 0), (0, -w % pages_per_block)))
    q_nkmd = jnp.swapaxes(q_bkgd[prefix.order_s].reshape(n, c, kv, g, d), 1, 2).reshape(n, kv, c * g, d)
    len_nm = jnp.repeat(prefix.len_s[prefix.order_s].reshape(n, c), g, axis=1)  # each query's keys

    def body(j, state):
        m_nkm, l_nkm, acc_nkmd = state
        pages_nb = jax.lax.dynamic_slice_in_dim(table_nw, j * pages_per_block, pages_per_block, axis=1)
        k_nskd = k_pool[layer, pages_nb].reshape(n, kv_block, kv, -1)
        v_nskd = v_pool[layer, pages_nb].reshape(n, kv_block, kv, -1)
        seen_nkms = ((j * kv_block + jnp.arange(kv_block))[None, None, :] < len_nm[:, :, None])[:, None]
        s_nkms = jnp.einsum("nkmd,nskd->nkms", q_nkmd, k_nskd, preferred_element_type=jnp.float32)
        s_nkms = jnp.where(seen_nkms, s_nkms * scale, _MASKED)
        m_new = jnp.maximum(m_nkm, s_nkms.max(axis=-1))
        # a query that reads no key of this block keeps its state: its terms are zeros, not exp(0)
        p_nkms = jnp.where(seen_nkms, jnp.exp(s_nkms - m_new[..., None]), 0.0)
        corr_nkm = jnp.exp(m_nkm - m_new)
        pv_nkmd = jnp.einsum("nkms,nskd->nkmd", p_nkms.astype(v_nskd.dtype), v_nskd,
                             preferred_element_type=jnp.float32)
        return m_new, l_nkm * corr_nkm + p_nkms.sum(axis=-1), acc_nkmd * corr_nkm[..., None] + pv_nkmd

    dv = v_pool.shape[-1]
    init = (jnp.full((n, kv, c * g), _MASKED, jnp.float32), jnp.zeros((n, kv, c * g), jnp.float32),
            jnp.zeros((n, kv, c * g, dv), jnp.float32))
    m_nkm, l_nkm, acc_nkmd = jax.lax.fori_loop(0, jnp.max(prefix.len_s) // kv_block, body, init)

    def by_row(x_nkm):  # [n, kv, c * g, ...] -> the batch's rows [b, kv, g, ...]
        x = jnp.swapaxes(x_nkm.reshape(n, kv, c, g, *x_nkm.shape[3:]), 1, 2)
        return x.reshape(b, kv, g, *x.shape[4:])[prefix.place_s]

    return by_row(m_nkm), by_row(l_nkm), by_row(acc_nkmd)
