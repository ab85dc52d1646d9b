"""Ragged paged attention as a Pallas kernel: the "pallas" implementation of `paged_attention`.

Same layout and semantics as tx/kernels/paged_attention.py (pools `[L, num_pages, page_size, kv_heads,
head_dim]`, one page table per row, a query at position p sees keys 0..p of its own row, page 0 the
trash page). Every row may have a different length and `t >= 1` queries (decode t=1, prefill chunks).

Grid `(b, kv_heads // hk, n_blocks)`: row, group of `hk` kv heads, KV block of `kv_block` tokens
(`kv_block // page_size` pages; the last axis is the reduction, in order). Scalar-prefetched (SMEM on
TPU, read by the index maps before each step): the layer index, the flattened page table, and each row's
last needed block `max(q_pos[b]) // kv_block`. Each step's K and V inputs are `pages_per_block` BlockSpecs
over the same pool, one page each, whose index maps read `(layer, table[b, block * ppb + i])`: a step
brings in exactly one block of one row's pages (all `hk` heads of each page). Steps past a row's last
block map to that block again, so the pipeline issues no new copy for them (a block index that does not
change is not fetched again), and their compute is skipped: a row reads only the pages up to its
furthest query.

In the kernel, per kv head: the row's `g * t` queries of that head (`[g*t, d]`, ordered (g, t)) against the
block's keys (pages concatenated, `[ppb * page, d]`), an online softmax in float32 (running max, sum and
output in VMEM scratch, as flash.py) under the causal mask at absolute positions, so a block with every key
past a query leaves that query's state bit-identical (its probabilities are exactly 0, the correction
exactly 1). The output block (constant over the reduction axis) is written once, at the last step.
A row's output depends only on its own inputs, never on the batch or the table width.

The kernel is compiled when the program is built for "tpu" (`platform`, passed in; the model's) and runs
in Pallas interpret mode elsewhere (as splash.py and gmm.py's megablox): the CPU tests run the same kernel
interpreted. The grid spec is `pltpu.PrefetchScalarGridSpec`, so on GPU it also runs interpreted (correct,
slow); the XLA "blocked" kernel is the GPU choice. The tests export the compiled kernel for TPU from CPU (it
passes Pallas's Mosaic lowering); it has not yet been compiled or timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tx.kernels.attention import _MASKED
from tx.kernels.interpret import default_interpret
from tx.kernels.platform import resolve

_PADDING_PAGE = 0  # the trash page (paged_attention.TRASH_PAGE): pads the table to whole blocks


def _kernel(layer_ref, table_ref, last_ref, pos_ref, q_ref, *refs, ppb: int, page: int, scale: float):
    """One (row, kv head group, KV block) step. refs: ppb K page refs, ppb V page refs, the output ref,
    then the scratch: running max and sum `[hk, r, 1]` and output `[hk, r, d]` (float32), r = g * t."""
    del layer_ref, table_ref  # read by the index maps only
    k_refs, v_refs, (out_ref, m_ref, l_ref, acc_ref) = refs[:ppb], refs[ppb:2 * ppb], refs[2 * ppb:]
    b, j = pl.program_id(0), pl.program_id(2)
    hk = q_ref.shape[0]
    kv_block = ppb * page

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j <= last_ref[b])
    def _block():
        pos_r1 = pos_ref[...]
        key_pos_1s = j * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)
        visible_rs = key_pos_1s <= pos_r1
        for k in range(hk):
            k_sd = jnp.concatenate([r[:, k, :] for r in k_refs], axis=0) if ppb > 1 else k_refs[0][:, k, :]
            v_sd = jnp.concatenate([r[:, k, :] for r in v_refs], axis=0) if ppb > 1 else v_refs[0][:, k, :]
            s_rs = jax.lax.dot_general(q_ref[k], k_sd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s_rs = jnp.where(visible_rs, s_rs * scale, _MASKED)
            m_old = m_ref[k]
            m_new = jnp.maximum(m_old, s_rs.max(axis=1, keepdims=True))
            p_rs = jnp.exp(s_rs - m_new)
            corr = jnp.exp(m_old - m_new)
            l_ref[k] = l_ref[k] * corr + p_rs.sum(axis=1, keepdims=True)
            pv_rd = jnp.dot(p_rs.astype(v_sd.dtype), v_sd, preferred_element_type=jnp.float32)
            acc_ref[k] = acc_ref[k] * corr + pv_rd
            m_ref[k] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        out_ref[...] = (acc_ref[...] / l_ref[...]).astype(out_ref.dtype)


def pallas_paged_attention(q_bthd, k_pool, v_pool, layer, table_bw, q_pos_bt, scale: float, kv_block: int = 128,
                           *, kv_heads_per_step: int | None = None, platform: str | None = None,
                           interpret: bool | None = None) -> jax.Array:
    """Causal GQA attention `[b, t, h, d]` over the rows' pages, KV blocks of `kv_block` tokens (a multiple
    of the page size). `kv_heads_per_step` (default: every kv head, a whole page per copy) divides
    kv_heads; compiled for TPU it is all of them or a multiple of 8. `interpret` defaults to True unless
    `platform` (default: JAX's first device's) is "tpu" (logged once)."""
    b, t, h, d = q_bthd.shape
    _, _, page, kv, _ = k_pool.shape
    if kv_block % page:
        raise ValueError(f"kv_block={kv_block} must be a multiple of the page size {page}")
    if h % kv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {kv}")
    hk = kv if kv_heads_per_step is None else kv_heads_per_step
    if hk < 1 or kv % hk:
        raise ValueError(f"kv_heads_per_step={kv_heads_per_step} must divide num kv heads {kv}")
    if interpret is None:
        interpret = default_interpret("paged_attention_impl", "pallas", resolve(platform))
    if not interpret and hk != kv and hk % 8:  # Mosaic: a block's second-minor dim is whole or a multiple of 8
        raise ValueError(f"kv_heads_per_step={kv_heads_per_step} must be num kv heads {kv} or a multiple of 8 "
                         "when compiled for TPU")
    g = h // kv
    r = g * t  # query rows per kv head, ordered (g, t)
    ppb = kv_block // page
    w = table_bw.shape[1]
    n_blocks = -(-w // ppb)
    table_flat = jnp.pad(table_bw.astype(jnp.int32), ((0, 0), (0, n_blocks * ppb - w)),
                         constant_values=_PADDING_PAGE).reshape(-1)
    last_b = jnp.minimum(jnp.max(q_pos_bt, axis=1) // kv_block, n_blocks - 1).astype(jnp.int32)
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
    q_bkrd = q_bthd.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, r, d)
    pos_br1 = jnp.tile(q_pos_bt.astype(jnp.int32), (1, g))[:, :, None]

    def page_spec(i):
        def index_map(bi, ki, j, layer_ref, table_ref, last_ref):
            block = jnp.minimum(j, last_ref[bi])  # past the row's last block: the same block, no new copy
            return layer_ref[0], table_ref[bi * n_blocks * ppb + block * ppb + i], 0, ki, 0
        return pl.BlockSpec((None, None, page, hk, d), index_map)

    q_spec = pl.BlockSpec((None, hk, r, d), lambda bi, ki, j, *_: (bi, ki, 0, 0))
    pos_spec = pl.BlockSpec((None, r, 1), lambda bi, ki, j, *_: (bi, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kv // hk, n_blocks),
        in_specs=[pos_spec, q_spec] + [page_spec(i) for i in range(ppb)] * 2,
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((hk, r, 1), jnp.float32), pltpu.VMEM((hk, r, 1), jnp.float32),
                        pltpu.VMEM((hk, r, d), jnp.float32)],
    )
    out_bkrd = pl.pallas_call(
        functools.partial(_kernel, ppb=ppb, page=page, scale=float(scale)),
        out_shape=jax.ShapeDtypeStruct((b, kv, r, d), q_bthd.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention",
    )(layer_1, table_flat, last_b, pos_br1, q_bkrd, *([k_pool] * ppb), *([v_pool] * ppb))
    return out_bkrd.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
