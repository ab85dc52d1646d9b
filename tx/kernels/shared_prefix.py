"""Decode attention's shared-prefix (cascade) part: the pages several rows share, read once for all of them.

The samples of one prompt (an RL group) hold the same prompt pages in their tables. Read row by row, each
page is gathered once per row; here the rows are laid out in segments of `c` rows (a permutation of the
batch the host picks, `SharedPrefix.order_s`), each segment has one table of pages its rows share
(`table_nw`), and each block of those pages is gathered once per segment and seen by all its rows.

Each row's products and online-softmax update are the row-by-row read's own (`paged_blocks.attend_block`,
the same product form), over the same keys in the same blocks: the state a row leaves here after its first
`len_s` keys is the one the row-by-row read holds after them, bit for bit, whatever the row's segment,
its mates or `len_s`. The row's own blocked loop continues from it at key `len_s` (a multiple of the block,
so no block is read twice). So the shared read changes what is gathered, never a row's result: a row gets
the same bits in any batch with it on or off. A row with `len_s` 0 (no segment shares its pages, or a
filler of a segment) leaves the state at its start.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx.kernels.paged_blocks import BlockState, Products, attend_block, gather_pages, initial_state
from tx.kernels.row_groups import map_row_groups


class SharedPrefix(NamedTuple):
    """Which rows read which shared pages (`n` segments of `c = b / n` rows each; every index is local to the
    device's rows where the batch is split over devices)."""

    order_s: jax.Array  # int32 [b]: the row at each place of the segment layout (a permutation)
    place_s: jax.Array  # int32 [b]: each row's place in it (the inverse permutation)
    table_nw: jax.Array  # int32 [n, w]: each segment's shared pages, in table order (padded with the trash page)
    len_s: jax.Array  # int32 [b]: keys each row reads from its segment's pages (a multiple of kv_block; 0: none)


def prefix_state(q_btkgd: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, prefix: SharedPrefix,
                 scale: float, kv_block: int, products: Products, groups: int = 1) -> BlockState:
    """One decode query per row, `q_btkgd` `[b, 1, kv, g, d]`, over the keys `0 .. len_s - 1` of its
    segment's pages: the online-softmax state in row order (`paged_blocks.BlockState`), blocks of `kv_block`
    tokens in a loop of as many blocks as the longest `len_s` spans, each gathered `[n, block, kv, d]` and
    broadcast to the segment's `c` rows (rows in segment order inside the loop). `groups`: the segments run in
    that many groups in turn (`row_groups.map_row_groups`; fewer where they do not divide `n`), each group's
    loop as long as its own longest `len_s`."""
    b, _, kv, g, _ = q_btkgd.shape
    n, w = prefix.table_nw.shape
    c = b // n
    pages_per_block = kv_block // k_pool.shape[2]
    table_nw = jnp.pad(prefix.table_nw, ((0, 0), (0, -w % pages_per_block)))

    def by_segment(x_b: jax.Array) -> jax.Array:  # rows in segment order, [n, c, 1, ...]: one-row batches
        return x_b[prefix.order_s].reshape(n, c, 1, *x_b.shape[1:])

    # a row's update is attend_block on a batch of that row alone, with the segment's block broadcast to it as
    # its own operand (unbatched, vmap would fold a segment's rows into one matmul: its sums in another order)
    segment_update = jax.vmap(jax.vmap(lambda state, q, k, v, mask: attend_block(state, q, k, v, mask, scale,
                                                                                  products)))

    def segments_state(q_nc1tkgd: jax.Array, len_nc1: jax.Array, table_nw: jax.Array) -> BlockState:
        m = table_nw.shape[0]

        def to_rows(x_mskd: jax.Array) -> jax.Array:  # [m, c, 1, block, kv, d]: the block seen by each of c rows
            return jnp.broadcast_to(x_mskd[:, None, None], (m, c, 1, *x_mskd.shape[1:]))

        def body(j, state: BlockState) -> BlockState:
            pages_mb = jax.lax.dynamic_slice_in_dim(table_nw, j * pages_per_block, pages_per_block, axis=1)
            k_mc1skd = to_rows(gather_pages(k_pool, layer, pages_mb))
            v_mc1skd = to_rows(gather_pages(v_pool, layer, pages_mb))
            mask_mc1ts = ((j * kv_block + jnp.arange(kv_block))[None, None, None, :] < len_nc1[..., None])[..., None, :]
            return segment_update(state, q_nc1tkgd, k_mc1skd, v_mc1skd, mask_mc1ts)

        init = initial_state(m * c, kv, g, 1, v_pool.shape[-1])
        return jax.lax.fori_loop(0, jnp.max(len_nc1) // kv_block, body,
                                 tuple(x.reshape(m, c, 1, *x.shape[1:]) for x in init))

    placed = map_row_groups(segments_state, (by_segment(q_btkgd), by_segment(prefix.len_s), table_nw),
                            math.gcd(groups, n))
    placed = tuple(x.reshape(b, *x.shape[3:]) for x in placed)
    # a row that reads no shared key starts as without a prefix (its all-masked blocks summed exp(0) terms)
    init = initial_state(b, kv, g, 1, v_pool.shape[-1])
    read_b = prefix.len_s > 0
    return tuple(jnp.where(read_b.reshape(-1, *[1] * (x.ndim - 1)), x[prefix.place_s], x0)
                 for x, x0 in zip(placed, init))
