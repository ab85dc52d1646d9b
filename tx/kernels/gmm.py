"""Grouped matmul over rows sorted by group: `out[r] = x[r] @ w[g(r)]`, one dispatch, three kernels.

Rows `x_mi` are sorted so that group g owns rows `[sum(sizes[:g]), sum(sizes[:g+1]))`; rows past
`sum(sizes)` belong to no group and come out zero (the `jax.lax.ragged_dot` contract).

- `ragged_dot`: XLA's grouped GEMM. A real one on GPU/TPU; XLA's CPU lowering runs a full `[m, i] x
  [i, o]` matmul per group (128 groups: 128x the work), so it is not the CPU choice.
- `blocked` (CPU): a loop over the non-empty groups only; each group's rows go through ONE matmul on a
  window of `c` rows, `c` the smallest size of a static ladder (`min_tile`, 2x, 4x, ..., m) that holds
  the group. A group's weight is read once, and the work is at most 2x the routed rows (plus
  `min_tile` per group), whatever the number of groups. A custom VJP computes dx with the same loop on
  the transposed weight and dw group by group into one `[g, i, o]` buffer, so the backward pass never
  materialises a full-size zero cotangent per loop step.
- `layer`: when `w` is a stack of layers' weights `[L, g, i, o]` (a scanned MoE stack), `layer` picks
  one. The blocked kernel indexes `[layer, g]` inside its loop, so the layer's `[g, i, o]` slice is
  never copied out (a `lax.scan` over the stacked weights copies each layer's slice: 3 x 400 MB per
  Qwen3-30B-A3B layer, measured 3.7x slower); the other kernels take the slice first.
- `megablox`: the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.megablox.gmm` (its own VJP with
  `tgmm`); compiled when the program is built for "tpu", elsewhere in Pallas interpret mode (logged once),
  which is how the tests check it.

"auto" picks by the platform the program is built for, passed in (`platform`, `tx.kernels.platform`; the MoE
layer carries its model's): "blocked" on cpu, "megablox" on tpu, "ragged_dot" elsewhere (GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tx.kernels.interpret import default_interpret
from tx.kernels.platform import resolve

GMM_IMPLS = ("auto", "ragged_dot", "blocked", "megablox")
_MEGABLOX_TILE = 128


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """The kernel `impl` names on `platform` (default: JAX's first device's): auto picks by platform."""
    if impl not in GMM_IMPLS:
        raise ValueError(f"gmm impl {impl!r} is not one of {GMM_IMPLS}")
    if impl != "auto":
        return impl
    return {"cpu": "blocked", "tpu": "megablox"}.get(resolve(platform), "ragged_dot")


def gmm(
    x_mi: jax.Array,
    w_gio: jax.Array,
    sizes_g: jax.Array,
    *,
    impl: str = "auto",
    preferred_element_type=jnp.float32,
    min_tile: int = 16,
    layer: jax.Array | None = None,
    platform: str | None = None,
) -> jax.Array:
    """`[m, o]` grouped product of sorted rows `x_mi` with per-group weights `w_gio` (`sizes_g` int32);
    with `layer` (an int32 scalar), `w_gio` is a layer stack `[L, g, i, o]` and `w_gio[layer]` is used.
    `platform`: what the program is built for (default: JAX's first device's)."""
    w_lgio = w_gio if layer is not None else w_gio[None]
    if x_mi.ndim != 2 or w_lgio.ndim != 4 or x_mi.shape[1] != w_lgio.shape[2]:
        want = "[g, i, o]" if layer is None else "[L, g, i, o] (with layer)"
        raise ValueError(f"gmm shapes x={x_mi.shape} w={w_gio.shape}: want x [m, i] and w {want}")
    if sizes_g.shape != (w_lgio.shape[1],):
        raise ValueError(f"gmm sizes shape {sizes_g.shape} != (groups,) = ({w_lgio.shape[1]},)")
    sizes_g = sizes_g.astype(jnp.int32)
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    platform = resolve(platform)
    kind = resolve_impl(impl, platform)
    if kind != "blocked":
        w_gio = jax.lax.dynamic_index_in_dim(w_lgio, layer, 0, keepdims=False)
    if kind == "ragged_dot":
        return jax.lax.ragged_dot(x_mi, w_gio, sizes_g, preferred_element_type=preferred_element_type)
    if kind == "megablox":
        return _megablox(x_mi, w_gio, sizes_g, jnp.dtype(preferred_element_type), platform)
    if min_tile < 1:
        raise ValueError(f"gmm min_tile={min_tile} must be >= 1")
    return _blocked(x_mi, w_lgio, sizes_g, layer, jnp.dtype(preferred_element_type), min_tile)


# ---- blocked (CPU) ---------------------------------------------------------------------------------


def _ladder(m: int, min_tile: int) -> tuple[int, ...]:
    """Window sizes min_tile, 2*min_tile, ... below m, then m itself."""
    sizes, c = [], min_tile
    while c < m:
        sizes.append(c)
        c *= 2
    return (*sizes, m)


def window_rows(sizes_g: jax.Array, m: int, min_tile: int) -> jax.Array:
    """Rows the blocked kernel computes for each group: its window size, 0 for an empty group."""
    ladder = _ladder(m, min_tile)
    return jnp.where(sizes_g > 0, jnp.asarray(ladder, jnp.int32)[_bucket(sizes_g, ladder)], 0)


def _bucket(sizes_g: jax.Array, ladder: tuple[int, ...]) -> jax.Array:
    """Index of the smallest window in `ladder` that holds each group."""
    return jnp.minimum(jnp.searchsorted(jnp.asarray(ladder, jnp.int32), sizes_g, side="left"), len(ladder) - 1)


def _for_each_group(sizes_g, m: int, min_tile: int, init, step):
    """`init` threaded through `step(c, g, lo, mask, carry)` once per non-empty group g, c its window.

    One loop per window size (over the groups of that size, a dynamic trip count), not a `switch`
    inside one loop: a conditional would copy the carry (the whole output) on every step.
    """
    ladder = _ladder(m, min_tile)
    end_g = jnp.cumsum(sizes_g)
    start_g = end_g - sizes_g
    bucket_g = jnp.where(sizes_g > 0, _bucket(sizes_g, ladder), -1)
    carry = init
    for b, c in enumerate(ladder):
        mine_g = bucket_g == b
        (order,) = jnp.nonzero(mine_g, size=sizes_g.shape[0], fill_value=0)

        def body(j, carry, c=c, order=order):
            g = order[j]
            return step(c, g, *_window(start_g[g], end_g[g], c, m), carry)

        carry = jax.lax.fori_loop(0, jnp.sum(mine_g, dtype=jnp.int32), body, carry)
    return carry


def _window(start, end, c: int, m: int):
    """First row of a c-row window holding rows [start, end) (clamped into [0, m)) and its row mask."""
    lo = jnp.clip(start, 0, m - c)
    rows = lo + jnp.arange(c, dtype=jnp.int32)
    return lo, (rows >= start) & (rows < end)


def _blocked_apply(x_mi, w_lgio, sizes_g, layer, out_dtype, min_tile: int, transpose_w: bool):
    """out[r] = x[r] @ w[layer, g] (or @ w[layer, g].T when transpose_w), float `out_dtype`."""
    m = x_mi.shape[0]
    n_out = w_lgio.shape[2] if transpose_w else w_lgio.shape[3]
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))

    def step(c, g, lo, mask, out_mo):
        x_ci = jax.lax.dynamic_slice_in_dim(x_mi, lo, c)
        y_co = jax.lax.dot_general(x_ci, w_lgio[layer, g], dims, preferred_element_type=out_dtype)
        kept = jax.lax.dynamic_slice_in_dim(out_mo, lo, c)
        return jax.lax.dynamic_update_slice_in_dim(out_mo, jnp.where(mask[:, None], y_co, kept), lo, 0)

    if m == 0:
        return jnp.zeros((0, n_out), out_dtype)
    return _for_each_group(sizes_g, m, min_tile, jnp.zeros((m, n_out), out_dtype), step)


def _blocked_tgmm(x_mi, dy_mo, sizes_g, layer, w_shape, w_dtype, min_tile: int):
    """dw[layer, g] = x[rows of g].T @ dy[rows of g], one `w_shape` buffer written group by group.

    The other layers' entries stay zero. A LoRA pass never asks for dw (XLA drops it); a full-weight
    pass through a scanned stack accumulates these per-layer buffers (a stack-sized add per layer)."""
    m = x_mi.shape[0]

    def step(c, g, lo, mask, dw_lgio):
        x_ci = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(x_mi, lo, c), 0)
        dy_co = jax.lax.dynamic_slice_in_dim(dy_mo, lo, c)
        dw_io = jax.lax.dot_general(x_ci, dy_co, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice(dw_lgio, dw_io.astype(w_dtype)[None, None], (layer, g, 0, 0))

    init = jnp.zeros(w_shape, w_dtype)
    return init if m == 0 else _for_each_group(sizes_g, m, min_tile, init, step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(x_mi, w_lgio, sizes_g, layer, out_dtype, min_tile):
    return _blocked_apply(x_mi, w_lgio, sizes_g, layer, out_dtype, min_tile, transpose_w=False)


def _blocked_fwd(x_mi, w_lgio, sizes_g, layer, out_dtype, min_tile):
    return _blocked(x_mi, w_lgio, sizes_g, layer, out_dtype, min_tile), (x_mi, w_lgio, sizes_g, layer)


def _blocked_bwd(out_dtype, min_tile, res, dy_mo):
    x_mi, w_lgio, sizes_g, layer = res
    dy_mo = dy_mo.astype(x_mi.dtype)
    dx_mi = _blocked_apply(dy_mo, w_lgio, sizes_g, layer, jnp.float32, min_tile, transpose_w=True)
    dw_lgio = _blocked_tgmm(x_mi, dy_mo, sizes_g, layer, w_lgio.shape, w_lgio.dtype, min_tile)
    return dx_mi.astype(x_mi.dtype), dw_lgio, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# ---- megablox (Pallas, TPU; interpret mode elsewhere) ------------------------------------------------


def _megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) of one megablox call: 128 or the whole dimension, so each block dim Mosaic sees is a
    multiple of 128 or whole. A function of the call's own (m, k, n), not a fixed tuple: the VJP calls gmm
    again with the weight transposed (k and n swapped), where a tuple sized for the forward pass would
    put `tk = min(128, i)` on a dimension of size `o` (the LoRA rank: refused by Mosaic)."""
    return min(_MEGABLOX_TILE, m), min(_MEGABLOX_TILE, k), min(_MEGABLOX_TILE, n)


def _megablox(x_mi, w_gio, sizes_g, out_dtype, platform: str):
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    m = x_mi.shape[0]
    # m must be a multiple of the row tile: pad, give the padding (and any rows past sum(sizes)) to the
    # last group, and zero those rows' outputs (so their cotangents, and their dw terms, are zero).
    tm = min(_MEGABLOX_TILE, max(8, -(-m // 8) * 8))
    m_pad = -(-max(m, 1) // tm) * tm
    total = jnp.sum(sizes_g)
    x_pad = jnp.pad(x_mi, ((0, m_pad - m), (0, 0)))
    sizes_pad = sizes_g.at[-1].add(m_pad - total)
    out = megablox_gmm(x_pad, w_gio, sizes_pad, out_dtype, _megablox_tiling, None, None, False,
                       default_interpret("moe_impl", "megablox", platform))
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.where((rows < total)[:, None], out[:m], 0).astype(out_dtype)
