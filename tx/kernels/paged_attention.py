"""Attention over a paged KV cache: the sampling engine's cache layout, writes and reads.

Layout, per stack of L layers: `k_pool_lnpkd` and `v_pool_lnpkd`, `[L, num_pages, page_size, kv_heads,
head_dim]`. A page id names the same token slots in every layer, so a sequence has one page table
`table_bw` (int32 `[b, W]`): its token at position t lives in page `table_bw[b, t // page_size]` at offset
`t % page_size`. Page 0 is the trash page: writes of padding tokens go there and tables are padded with 0;
it is never read unmasked. Pool contents must be finite (they are K/V of real or padding tokens), since a
masked key's value is multiplied by an exact zero.

`paged_attention(q, k_pool, v_pool, layer, table, q_pos, scale, impl)`: a query at position p sees the keys
at positions 0..p of its own sequence (everything before it is already in its pages, and a prefill chunk's
K/V is written before it attends). Kernels (`PAGED_ATTENTION_IMPLS`):
- "reference": gathers every page of the table and runs the dense `attention` under a mask. The oracle.
- "blocked": an online softmax (float32 running max, sum and output, as flash.py) over KV blocks of
  `kv_block` tokens at fixed absolute positions, looping only over the blocks the longest query needs. A
  block past a row's last visible key is fully masked, and a fully masked block leaves the running state
  bit-identical (its probabilities are exactly 0 and the correction exactly 1). So a row's output is the
  same sequence of operations whatever the table width or the other rows' lengths: a sequence samples the
  same tokens alone or in any batch. (Decode forms its products one way at one row and another at more on
  CPU, `decode_products`, and there runs more than 64 rows in groups, `decode_row_groups`: a row alone and
  in a batch agree to float32 rounding, ~1e-7.)
- "pallas": the same online softmax as a Pallas ragged paged attention kernel (tx/kernels/paged_pallas.py):
  grid (row, kv head group, KV block) over scalar-prefetched page tables, so each step copies one block of
  one row's pages, and a row stops at its own last block. For TPU: compiled when the program is built for
  "tpu" (`platform`, the model's; `tx.kernels.platform`), interpret mode elsewhere (CPU tests).
Reads gather `pool[layer, pages]` in one indexing step: never slice `pool[layer]` first (a copy of the
layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tx.kernels.attention import attention
from tx.kernels.paged_blocks import (DECODE_PRODUCTS, attend_block, block_products, decode_products,
                                     decode_row_groups, gather_pages, initial_state)
from tx.kernels.paged_pallas import pallas_paged_attention
from tx.kernels.row_groups import map_row_groups
from tx.kernels.shared_prefix import SharedPrefix, prefix_state

__all__ = ["DECODE_PRODUCTS", "PAGED_ATTENTION_IMPLS", "TRASH_PAGE", "PagedKV", "blocked_paged_attention",
           "decode_products", "paged_attention", "reference_paged_attention", "token_slots", "write_kv_pages"]

TRASH_PAGE = 0


def write_kv_pages(pool_lnpkd: jax.Array, layer: jax.Array | int, new_btkd: jax.Array, page_bt: jax.Array,
                   offset_bt: jax.Array) -> jax.Array:
    """`pool` with `new[b, t]` written at `(layer, page[b, t], offset[b, t])`: one scatter, in place when
    the pool is donated. Padding tokens should point at `TRASH_PAGE`."""
    return pool_lnpkd.at[layer, page_bt, offset_bt].set(new_btkd.astype(pool_lnpkd.dtype))


def token_slots(table_bw: jax.Array, pos_bt: jax.Array, page_size: int,
                valid_bt: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(page, offset) `[b, t]` of the tokens at positions `pos_bt`; invalid tokens go to the trash page."""
    page_bt = jnp.take_along_axis(table_bw, pos_bt // page_size, axis=1)
    offset_bt = pos_bt % page_size
    if valid_bt is not None:
        page_bt = jnp.where(valid_bt, page_bt, TRASH_PAGE)
    return page_bt, offset_bt


def reference_paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale: float,
                              kv_block: int = 0) -> jax.Array:
    """Dense attention over every page of the table (`kv_block` is ignored)."""
    del kv_block
    k_bskd, v_bskd = gather_pages(k_pool, layer, table_bw), gather_pages(v_pool, layer, table_bw)
    key_pos_s = jnp.arange(k_bskd.shape[1])
    mask_bts = key_pos_s[None, None, :] <= q_pos_bt[:, :, None]
    return attention(q_bthd, k_bskd, v_bskd, mask_bts, scale)


def blocked_paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale: float,
                            kv_block: int = 128, kv_blocks: int | None = None, platform: str | None = None,
                            products: str | None = None, prefix: SharedPrefix | None = None) -> jax.Array:
    """Online-softmax attention over blocks of `kv_block` tokens (a multiple of the page size): the blocks
    the furthest query needs (a loop whose count the device finds), or exactly `kv_blocks` (static, at
    least that many: a loop of known count, which a GPU runs without asking the host). Decode forms its
    products as `products` names ("dot" or "reduce"; None: as `decode_products(b, platform)` says).
    `prefix` (decode only): each row's first `prefix.len_s` keys are read through its segment's shared pages
    (tx/kernels/shared_prefix.py), and its own loop starts at the block after them. Decode on CPU runs its rows
    in groups (`decode_row_groups`), each group's loop as far as its own furthest row."""
    b, t, h, d = q_bthd.shape
    page = k_pool.shape[2]
    kv = k_pool.shape[3]
    if kv_block % page:
        raise ValueError(f"kv_block={kv_block} must be a multiple of the page size {page}")
    pages_per_block = kv_block // page
    w = table_bw.shape[1]
    padded_w = max(-(-w // pages_per_block), kv_blocks or 0) * pages_per_block
    table_bw = jnp.pad(table_bw, ((0, 0), (0, padded_w - w)), constant_values=TRASH_PAGE)
    q_btkgd = q_bthd.reshape(b, t, kv, h // kv, d)
    products_fns = block_products(t, products or decode_products(b, platform))
    init = initial_state(b, kv, h // kv, t, v_pool.shape[-1])
    groups = decode_row_groups(b, platform) if t == 1 else 1
    first_b = None  # each row's first block of its own (with a prefix)
    if prefix is not None:
        if t != 1:
            raise ValueError(f"a shared prefix is read by decode (one query per row), not by {t} queries a row")
        init = prefix_state(q_btkgd, k_pool, v_pool, layer, prefix, scale, kv_block, products_fns, groups)
        first_b = prefix.len_s // kv_block

    def rows_out(q_btkgd, table_bw, q_pos_bt, m_bkgt, l_bkgt, acc_btkgd, first_b):  # own blocks, after shared
        if first_b is None:  # the blocks the furthest query needs
            n_blocks = jnp.max(q_pos_bt) // kv_block + 1
        else:
            n_blocks = jnp.max(q_pos_bt[:, -1] // kv_block + 1 - first_b)

        def body(j, state):
            if first_b is None:
                pages_bm = jax.lax.dynamic_slice_in_dim(table_bw, j * pages_per_block, pages_per_block, axis=1)
                key_pos_bs = (j * kv_block + jnp.arange(kv_block))[None]
            else:  # block j of each row's own: past the table's end (a row with fewer blocks) fully masked
                block_b = first_b + j
                at_bm = block_b[:, None] * pages_per_block + jnp.arange(pages_per_block)
                pages_bm = jnp.take_along_axis(table_bw, jnp.minimum(at_bm, padded_w - 1), axis=1)
                key_pos_bs = block_b[:, None] * kv_block + jnp.arange(kv_block)
            k_bskd, v_bskd = gather_pages(k_pool, layer, pages_bm), gather_pages(v_pool, layer, pages_bm)
            mask_bts = key_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
            return attend_block(state, q_btkgd, k_bskd, v_bskd, mask_bts, scale, products_fns)

        if kv_blocks is None:
            _, (_, l_bkgt, acc_btkgd) = jax.lax.while_loop(lambda c: c[0] < n_blocks,
                                                           lambda c: (c[0] + 1, body(c[0], c[1])),
                                                           (jnp.int32(0), (m_bkgt, l_bkgt, acc_btkgd)))
        else:  # the extra blocks are fully masked: exact no-ops
            _, l_bkgt, acc_btkgd = jax.lax.fori_loop(0, kv_blocks, body, (m_bkgt, l_bkgt, acc_btkgd))
        return acc_btkgd / jnp.moveaxis(l_bkgt, -1, 1)[..., None]

    out_btkgd = map_row_groups(rows_out, (q_btkgd, table_bw, q_pos_bt, *init, first_b), groups)
    return out_btkgd.reshape(b, t, h, d).astype(q_bthd.dtype)


PagedAttentionFn = Callable[..., jax.Array]

PAGED_ATTENTION_IMPLS: dict[str, PagedAttentionFn] = {
    "reference": reference_paged_attention,
    "blocked": blocked_paged_attention,
    "pallas": pallas_paged_attention,
}


def paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale: float, impl: str = "blocked",
                    kv_block: int = 128, platform: str | None = None, kv_blocks: int | None = None,
                    prefix: SharedPrefix | None = None) -> jax.Array:
    """Causal GQA attention `[b, t, h, d]` of queries at positions `q_pos_bt` over their sequences' pages,
    in a program built for `platform` (default: JAX's first device's). `kv_blocks` (static, "blocked"
    only): loop over that many blocks instead of finding the count on the device. `prefix` ("blocked"
    decode only): pages rows share, read once per segment of rows (tx/kernels/shared_prefix.py)."""
    if impl not in PAGED_ATTENTION_IMPLS:
        raise ValueError(f"paged_attention_impl={impl!r} is not one of {', '.join(PAGED_ATTENTION_IMPLS)}")
    if prefix is not None and impl != "blocked":
        raise ValueError(f"a shared prefix is read by paged_attention_impl='blocked' only, not {impl!r}")
    if impl == "pallas":
        return pallas_paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale, kv_block,
                                      platform=platform)
    if impl == "blocked":
        return blocked_paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale, kv_block, kv_blocks,
                                       platform, prefix=prefix)
    return PAGED_ATTENTION_IMPLS[impl](q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale, kv_block)


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """What a layer needs to write and read the paged cache: one stack's pools, the layer's index in it,
    the sequences' page tables and the positions of this call's tokens (`valid_bt` False: padding, written
    to the trash page). `v_pool` None: one pool of per-token entries that serve as keys and (a leading part
    of them) as values (latent attention, DeepSeek-V3). `impl`, `kv_block`, `platform` (the program's; None:
    JAX's first device's) and `kv_blocks` (None: found on the device; see `paged_attention`) are static.
    `prefix`: the rows' shared pages (decode, "blocked" only; None: every row reads its own table)."""

    k_pool: jax.Array
    v_pool: jax.Array | None
    layer: jax.Array
    table_bw: jax.Array
    pos_bt: jax.Array
    valid_bt: jax.Array
    impl: str = "blocked"
    kv_block: int = 128
    platform: str | None = None
    kv_blocks: int | None = None
    prefix: SharedPrefix | None = None  # decode: pages rows share (tx/kernels/shared_prefix.py)

    @property
    def pools(self) -> tuple[jax.Array, ...]:
        """(k_pool, v_pool), or (k_pool,) for one latent pool."""
        return (self.k_pool,) if self.v_pool is None else (self.k_pool, self.v_pool)

    def with_pools(self, pools: tuple[jax.Array, ...], layer: jax.Array) -> PagedKV:
        """This cache over `pools` (as `pools` gives them) at `layer`."""
        return dataclasses.replace(self, k_pool=pools[0], v_pool=pools[1] if len(pools) > 1 else None, layer=layer)

    def write(self, k_btkd: jax.Array, v_btkd: jax.Array | None = None) -> PagedKV:
        """This cache with this call's keys/values `[b, t, kv, d]` (or latent entries, without a v pool)
        written into its pools (each token at its page slot, padding into the trash page)."""
        page_bt, offset_bt = token_slots(self.table_bw, self.pos_bt, self.k_pool.shape[2], self.valid_bt)
        k_pool = write_kv_pages(self.k_pool, self.layer, k_btkd, page_bt, offset_bt)
        v_pool = None if self.v_pool is None else write_kv_pages(self.v_pool, self.layer, v_btkd, page_bt, offset_bt)
        return dataclasses.replace(self, k_pool=k_pool, v_pool=v_pool)

    def read(self, q_bthd: jax.Array, scale: float) -> jax.Array:
        """The queries' attention `[b, t, h, d]` over the pools as they are (write first); over a latent pool
        the values are the entries themselves."""
        v_pool = self.k_pool if self.v_pool is None else self.v_pool
        return paged_attention(q_bthd, self.k_pool, v_pool, self.layer, self.table_bw, self.pos_bt, scale,
                               self.impl, self.kv_block, self.platform, self.kv_blocks, self.prefix)

    def attend(self, q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array,
               scale: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Write this call's keys/values, then attend: (output `[b, t, h, d]`, updated pools)."""
        cache = self.write(k_btkd, v_btkd)
        return cache.read(q_bthd, scale), (cache.k_pool, cache.v_pool)


jax.tree_util.register_dataclass(PagedKV, data_fields=["k_pool", "v_pool", "layer", "table_bw", "pos_bt", "valid_bt",
                                                          "prefix"],
                                 meta_fields=["impl", "kv_block", "platform", "kv_blocks"])
