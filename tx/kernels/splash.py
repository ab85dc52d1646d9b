"""Causal, segment-masked GQA self-attention through JAX's Pallas TPU splash-attention kernel.

Same visibility rule as `tx.kernels.flash` (j <= i and seg[i] == seg[j], padding = -1). Each kv head and
its group of query heads is one MQA splash call (k/v are never repeated), vmapped over batch and kv
heads. The kernel wants lengths that are a multiple of its 128-lane blocks, so the sequence is padded
with segment -1 at the end (invisible to real queries by causality). The kernel is compiled when `platform`
is "tpu"; elsewhere it runs in Pallas interpret mode (the CPU tests; logged once, `tx.kernels.interpret`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from tx.kernels.interpret import default_interpret
from tx.kernels.platform import resolve

_LANES = 128  # splash's kv compute block must be a multiple of the TPU lane count
DEFAULT_BLOCK = 512


@functools.lru_cache(maxsize=64)
def _kernel(t: int, group: int, block: int, interpret: bool):
    mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(group)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )
    # Cached across traces: its mask arrays must be concrete (built eagerly, even when first asked for while
    # tracing, else the cache would keep the first trace's tracers) and host-side (numpy constants).
    with jax.ensure_compile_time_eval():
        kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    return jax.tree.map(np.asarray, kernel)


def splash_attention(
    q_bthd: jax.Array,
    k_btkd: jax.Array,
    v_btkd: jax.Array,
    segment_ids_bt: jax.Array,
    scale: float,
    *,
    block: int = DEFAULT_BLOCK,
    platform: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """[b, t, h, d] attention output for `platform` (default: JAX's first device's). `interpret` defaults
    to True unless `platform` is "tpu" (logged once)."""
    b, t, h, d = q_bthd.shape
    kv = k_btkd.shape[2]
    if h % kv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {kv}")
    if block < _LANES or block % _LANES:
        raise ValueError(f"block={block} must be a positive multiple of {_LANES}")
    if interpret is None:
        interpret = default_interpret("attention_impl", "splash", resolve(platform))
    padded = -(-t // _LANES) * _LANES
    block = min(block, padded)
    padded = -(-padded // block) * block
    pad = padded - t
    seg = segment_ids_bt.astype(jnp.int32)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_bthd, k_btkd, v_btkd = (jnp.pad(x, widths) for x in (q_bthd, k_btkd, v_btkd))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    g = h // kv
    q_bkgtd = (q_bthd * jnp.asarray(scale, q_bthd.dtype)).reshape(b, padded, kv, g, d).transpose(0, 2, 3, 1, 4)
    k_bktd, v_bktd = k_btkd.transpose(0, 2, 1, 3), v_btkd.transpose(0, 2, 1, 3)
    kernel = _kernel(padded, g, block, bool(interpret))

    def one(q_gtd, k_td, v_td, seg_t):
        return kernel(q_gtd, k_td, v_td, splash.SegmentIds(q=seg_t, kv=seg_t))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))  # kv heads share the row's segment ids
    out_bkgtd = jax.vmap(per_head)(q_bkgtd, k_bktd, v_bktd, seg)
    return out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, d)[:, :t]
