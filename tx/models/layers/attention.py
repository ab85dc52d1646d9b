"""Qwen3 grouped-query self-attention with per-head q/k RMSNorm and RoPE.

The projections, norms and RoPE are GSPMD code under the logical-axis constraints (`tx.models.logical`).
The attention kernel itself runs per device (`LogicalSharding.local`, a `shard_map`): attention is
independent across rows and across kv-head groups, so each device attends its own rows (batch over its
mesh axis, e.g. fsdp) and its own heads (heads and kv heads over theirs, e.g. tp; the rules split both or
neither, so a device's query heads are exactly the groups of its kv heads). That holds for every kernel:
Pallas/Mosaic calls (splash, the paged kernel) cannot be partitioned by GSPMD at all, and the XLA ones
(blockwise, cuDNN, the paged "blocked" kernel's `[b, s * kv, d]` decode reshape) need no guess from it.
A dimension that does not divide its mesh axis (one decode row over fsdp) stays whole on every device.

The paged cache (the sampling engine) is written outside the per-device region: the page pools hold every
row's pages on every fsdp device (kv heads split like the keys), so each replica must receive every row's
new keys/values, which GSPMD's scatter does. Only the read (the attention over the pages) runs per device.

Gradients are per device too (`local_with_local_grads`): differentiating the `shard_map` itself would
divide the output's cotangent over, and all-reduce dq, dk, dv over, every mesh axis the inputs are
replicated on (ep always, as attention has no expert axis): one useless collective per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from tx.kernels.attention import SelfAttentionMask, self_attention
from tx.kernels.paged_attention import PagedKV, paged_attention
from tx.kernels.shared_prefix import SharedPrefix
from tx.models.config import ModelConfig
from tx.models.layers.lora import LoRALinear, grouped
from tx.models.layers.norm import RMSNorm
from tx.models.layers.rope import apply_rope
from tx.models.logical import NO_SHARDING, LogicalSharding

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
POOL_AXES = ("layers", None, None, "kv_heads", "head_dim")  # the engine's page pools `[L, N, P, kv, d]`
PREFIX_AXES = (("batch",), ("batch",), ("batch", None), ("batch",))  # `SharedPrefix`'s arrays: split by rows


@dataclasses.dataclass(eq=False)
class _Pullback:
    """The static part of a device's pullback (its tree, and the constant leaves, e.g. a kernel's numpy
    mask tables); its traced leaves travel as arrays. Compared by identity."""

    tree: jax.tree_util.PyTreeDef
    static: list  # the constant leaves, None where a leaf is traced
    traced: list[bool]
    differentiable: tuple[bool, ...]  # per input: floating (gets a cotangent) or not (ids, masks)


jax.tree_util.register_static(_Pullback)


def local_with_local_grads(shard: LogicalSharding, fn: Callable, in_names: Sequence, out_names: Sequence,
                           shapes: Sequence, out_shape: Sequence[int]) -> Callable:
    """`shard.local(fn, in_names, out_names, *shapes, out_shapes=out_shape)` (one output) whose backward pass
    also runs per device, on that device's own residuals, with no collective.

    Differentiating the `shard_map` (`check_vma=False`, which the Pallas kernels need) treats every mesh axis
    an input is not split over as a sum: the output's cotangent is divided by its size and each input's
    cotangent all-reduced over it, although every device along it computed the same values. Here the forward
    returns, besides its output, each device's pullback (`jax.vjp`'s, a pytree) with its traced residuals
    stacked on a leading axis of one entry per device, and the backward calls it per device. Each device then
    holds the cotangents of its own shards; along an axis an input is replicated on, every device holds the
    same (whole) cotangent, as it held the same input: what the summed form computes, without the
    all-reduce. Inputs that are not floating (segment ids, masks) get none."""
    forward = shard.local(fn, in_names, out_names, *shapes, out_shapes=out_shape)
    mesh = shard.mesh
    if mesh is None or mesh.size == 1:
        return forward
    in_specs = tuple(P() if n is None else shard.spec(n, s) for n, s in zip(in_names, shapes))
    out_spec = shard.spec(out_names, out_shape)
    per_device = P(mesh.axis_names)

    @jax.custom_vjp
    def run(*args):
        return forward(*args)

    def run_fwd(*args):
        found = {}

        def body(*local_args):
            out, pullback = jax.vjp(fn, *local_args)
            leaves, tree = jax.tree.flatten(pullback)
            traced = [isinstance(x, jax.core.Tracer) for x in leaves]
            found["meta"] = _Pullback(tree, [None if t else x for x, t in zip(leaves, traced)], traced,
                                      tuple(jnp.issubdtype(a.dtype, jnp.inexact) for a in local_args))
            return out, [x[None] for x, t in zip(leaves, traced) if t]

        out, stacked = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(out_spec, per_device),
                                     check_vma=False)(*args)
        return out, (stacked, found["meta"])

    def run_bwd(res, ct):
        stacked, meta = res

        def body(ct, *stacked):
            rows = iter(stacked)
            leaves = [next(rows)[0] if t else x for x, t in zip(meta.static, meta.traced)]
            cts = jax.tree.unflatten(meta.tree, leaves)(ct)
            return tuple(c for c, d in zip(cts, meta.differentiable) if d)

        specs = tuple(s for s, d in zip(in_specs, meta.differentiable) if d)
        grads = iter(jax.shard_map(body, mesh=mesh, in_specs=(out_spec, *[per_device] * len(stacked)),
                                   out_specs=specs, check_vma=False)(ct, *stacked))
        return tuple(next(grads) if d else None for d in meta.differentiable)

    run.defvjp(run_fwd, run_bwd)
    return run


def local_paged_attention(shard: LogicalSharding, cache: PagedKV, q_bthd: jax.Array, scale: float) -> jax.Array:
    """`cache.read(q_bthd, scale)` per device: its rows (with their page tables and positions) and its query
    heads against its kv heads of every page (the pools are laid out by `POOL_AXES`: whole over the batch's
    axes, kv heads split like the queries' heads). Never differentiated (sampling)."""
    pool_shape = cache.k_pool.shape
    if shard.mesh is not None:
        heads_axis = shard.spec(Q_AXES, q_bthd.shape)[2]
        pool_spec = shard.spec(POOL_AXES, pool_shape)
        if tuple(pool_spec) != (None, None, None, heads_axis, None):
            raise ValueError(f"page pools {pool_shape} laid out as {pool_spec} by logical_axis_rules={shard.rules}: "
                             f"a device's attention needs every layer and page, and the kv heads split like the "
                             f"query heads (over {heads_axis!r})")
    return local_paged_read(shard, cache, q_bthd, scale, POOL_AXES)


def local_paged_read(shard: LogicalSharding, cache: PagedKV, q_bthd: jax.Array, scale: float,
                     pool_axes: tuple) -> jax.Array:
    """`cache.read(q_bthd, scale)` per device, its pools laid out by `pool_axes` (one latent pool reads its
    entries as keys and values); a shared prefix's arrays split by rows like the queries."""
    kernel = functools.partial(paged_attention, scale=scale, impl=cache.impl, kv_block=cache.kv_block,
                               platform=cache.platform, kv_blocks=cache.kv_blocks)
    pools, prefix = cache.pools, () if cache.prefix is None else tuple(cache.prefix)

    def read(q, *args):
        held, (layer, table, pos), shared = args[:len(pools)], args[len(pools):len(pools) + 3], args[len(pools) + 3:]
        return kernel(q, held[0], held[-1], layer, table, pos, prefix=SharedPrefix(*shared) if shared else None)

    names = (Q_AXES, *(pool_axes,) * len(pools), None, ("batch", None), ("batch", "length"),
             *(PREFIX_AXES if prefix else ()))
    run = shard.local(read, names, Q_AXES, q_bthd.shape, *(p.shape for p in pools), (), cache.table_bw.shape,
                      cache.pos_bt.shape, *(x.shape for x in prefix), out_shapes=q_bthd.shape)
    return run(q_bthd, *pools, cache.layer, cache.table_bw, cache.pos_bt, *prefix)


class Attention(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs,
        shard: LogicalSharding = NO_SHARDING,
    ):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.shard = shard
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        kw = dict(num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs, shard=shard)
        self.q_proj = LoRALinear(d, self.num_heads * hd, name="q_proj", **kw)
        self.k_proj = LoRALinear(d, self.num_kv_heads * hd, name="k_proj", **kw)
        self.v_proj = LoRALinear(d, self.num_kv_heads * hd, name="v_proj", **kw)
        self.o_proj = LoRALinear(self.num_heads * hd, d, name="o_proj", **kw)
        if cfg.qk_norm:  # Qwen3's per-head norms; Llama has none
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, stack=stack, dtype=dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.qk_norm = cfg.qk_norm

    def __call__(
        self,
        x_btd: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        mask: SelfAttentionMask | None,
        adapter_b: jax.Array | None,
        cache: PagedKV | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attention output [b, t, d], and None or the updated page pools.

        Without `cache`, queries attend over this call's own keys (training, scoring) with the kernel and
        segment ids of `mask` (a `SelfAttentionMask`). With a `PagedKV` (the sampling engine), this call's
        keys/values are written into its pages and queries attend over their sequences' pages (`mask`
        unused); the updated pools `(k_pool, v_pool)` are returned. The kernel runs per device (module doc)."""
        b, t, _ = x_btd.shape
        q_btf, k_btf, v_btf = grouped((self.q_proj, self.k_proj, self.v_proj), x_btd, adapter_b)
        q_bthd = q_btf.reshape(b, t, self.num_heads, self.head_dim)
        k_btkd = k_btf.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q_bthd, k_btkd = self.q_norm(q_bthd), self.k_norm(k_btkd)
        v_btkd = v_btf.reshape(b, t, self.num_kv_heads, self.head_dim)
        q_bthd, k_btkd = apply_rope(q_bthd, *cos_sin), apply_rope(k_btkd, *cos_sin)
        q_bthd = self.shard.constrain(q_bthd, Q_AXES)
        k_btkd = self.shard.constrain(k_btkd, KV_AXES)
        v_btkd = self.shard.constrain(v_btkd, KV_AXES)
        scale = self.head_dim**-0.5
        if cache is not None:
            cache = cache.write(k_btkd, v_btkd)  # GSPMD: every fsdp replica of the pools gets every row's entries
            out_bthd = local_paged_attention(self.shard, cache, q_bthd, scale)
            return self.o_proj(out_bthd.reshape(b, t, -1), adapter_b), cache.pools
        kernel = functools.partial(self_attention, scale=scale, impl=mask.impl, platform=mask.platform)
        rows_mask = mask.segment_ids_bt
        run = local_with_local_grads(self.shard, kernel, (Q_AXES, KV_AXES, KV_AXES, ("batch", "length")), Q_AXES,
                                     (q_bthd.shape, k_btkd.shape, v_btkd.shape, rows_mask.shape), q_bthd.shape)
        out_bthd = run(q_bthd, k_btkd, v_btkd, rows_mask)
        return self.o_proj(out_bthd.reshape(b, t, -1), adapter_b), None
