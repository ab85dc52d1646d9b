"""Qwen3-MoE sparse block: softmax router, top-k experts, grouped matmuls over stacked expert weights.

Expert LoRA is grouped only over the P adapter slots present in the batch (P = min(slots, batch rows),
a static bound): each row's slot is renumbered to its index among the present ones, and token-expert
rows are sorted once by `expert * P + present_index`. In that order the rows of each expert are
contiguous (base weights: E groups) and so are the rows of each (expert, present adapter) pair (the
present slots' LoRA weights gathered to `[E, P, ...]`: E*P groups), so one sort serves every grouped
matmul (`tx.kernels.gmm`, whose CPU kernel costs the rows routed, not the number of groups).
The LoRA path runs in float32 (the adapters' dtype) whatever the model dtype, as PEFT does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.gmm import gmm, resolve_impl
from tx.kernels.lora import make_routing
from tx.kernels.platform import normalise, platform_of
from tx.models.config import ModelConfig
from tx.models.layers.lora import lora_variables
from tx.models.layers.mlp import MLP
from tx.models.logical import LINEAR_AXES, NO_SHARDING, LogicalSharding

_init = nnx.initializers.normal(0.02)


class ExpertRows(NamedTuple):
    """Rows sorted by (expert, present adapter): group sizes at both granularities, the present slots, each
    row's adapter slot (its LoRA scale index), and the grouped-matmul kernel and the platform it is built for."""

    expert_sizes_e: jax.Array  # int32 [E]
    lora_sizes_g: jax.Array  # int32 [E * P]
    slots_p: jax.Array  # int32 [P]: present adapter slots (unused entries repeat slot 0 and own no rows)
    adapter_r: jax.Array  # int32 [rows], sorted order
    impl: str
    layer: jax.Array | None  # int32 scalar: the layer of a scanned stack whose expert kernels are `[L, E, ...]`
    platform: str  # normalised (`tx.kernels.platform`): picks "auto" and compiles or interprets megablox


def present_slots(adapter_b: jax.Array, num_adapters: int) -> tuple[jax.Array, jax.Array]:
    """The distinct slots of `adapter_b` ascending, padded with 0 to P = min(num_adapters, b), and each
    row's index among them."""
    bound = min(num_adapters, adapter_b.shape[0])
    present_a = jnp.zeros((num_adapters,), bool).at[adapter_b].set(True)
    (slots_p,) = jnp.nonzero(present_a, size=bound, fill_value=0)
    index_a = jnp.cumsum(present_a, dtype=jnp.int32) - 1
    return slots_p.astype(jnp.int32), index_a[adapter_b]


class ExpertWeights(NamedTuple):
    """One expert projection's arrays, as a per-device computation receives them."""

    kernel: jax.Array  # [E, in, out], or the whole stack [L, E, in, out]
    lora_a: jax.Array  # [E, A, in, R]
    lora_b: jax.Array  # [E, A, R, out]
    lora_scale: jax.Array  # [A]


def expert_linear(x_ri: jax.Array, w: ExpertWeights, rows: ExpertRows, use_lora: bool) -> jax.Array:
    """float32 `[rows, out]`: each sorted row times its expert's kernel, plus its adapter's LoRA delta."""
    y_ro = gmm(x_ri, w.kernel, rows.expert_sizes_e, impl=rows.impl, layer=rows.layer, platform=rows.platform)
    if use_lora:
        a_epir = w.lora_a[:, rows.slots_p]
        e, p, i, r = a_epir.shape
        b_gro = w.lora_b[:, rows.slots_p].reshape(e * p, r, -1)
        h_rr = gmm(x_ri.astype(a_epir.dtype), a_epir.reshape(e * p, i, r), rows.lora_sizes_g, impl=rows.impl,
                   platform=rows.platform)
        delta_ro = gmm(h_rr, b_gro, rows.lora_sizes_g, impl=rows.impl, platform=rows.platform)
        y_ro = y_ro + delta_ro * w.lora_scale[rows.adapter_r][:, None]
    return y_ro


class ExpertLinear(nnx.Module):
    """`kernel [E, in, out]` plus per-expert LoRA `lora_a [E, A, in, R]`, `lora_b [E, A, R, out]`.

    Under a scanned stack the kernel may arrive whole, `[L, E, in, out]`, with `rows.layer` naming the
    layer (see `DecoderStack`): the grouped matmul indexes it in place instead of copying a slice."""

    def __init__(
        self,
        num_experts: int,
        in_f: int,
        out_f: int,
        *,
        num_adapters: int,
        rank: int,
        stack: tuple[int, ...],
        dtype,
        rngs: nnx.Rngs,
    ):
        self.kernel = nnx.Param(_init(rngs.params(), (*stack, num_experts, in_f, out_f), dtype))
        self.lora_a, self.lora_b, self.lora_scale = lora_variables(
            stack, num_adapters, rank, in_f, out_f, experts=(num_experts,)
        )

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.kernel[...], self.lora_a[...], self.lora_b[...], self.lora_scale[...])


def _weight_names(w: ExpertWeights, axes: tuple[str, str]) -> list[tuple[str | None, ...]]:
    """Logical names of an expert projection's arrays (`axes`: its in/out axes, `LINEAR_AXES`)."""
    i, o = axes
    return [("layers",) * (w.kernel.ndim - 3) + ("expert", i, o), ("expert", "adapter", i, "rank"),
            ("expert", "adapter", "rank", o), ("adapter",)]


class RouterBias(nnx.Variable):
    """DeepSeek-V3's `e_score_correction_bias` [E]: added to the expert scores only to choose experts (a
    load-balancing statistic of pretraining; float32, never trained here, as transformers keeps it a buffer)."""


class Router(nnx.Module):
    def __init__(self, d: int, num_experts: int, *, stack: tuple[int, ...], dtype, rngs: nnx.Rngs, bias: bool = False):
        self.kernel = nnx.Param(_init(rngs.params(), (*stack, d, num_experts), dtype))
        if bias:
            self.e_score_correction_bias = RouterBias(jnp.zeros((*stack, num_experts), jnp.float32))

    def bias(self, num_experts: int) -> jax.Array:
        """float32 [E] (zeros for a router without one)."""
        if hasattr(self, "e_score_correction_bias"):
            return self.e_score_correction_bias[...]
        return jnp.zeros((*self.kernel.shape[:-2], num_experts), jnp.float32)


def sigmoid_grouped_topk(logits_ne: jax.Array, bias_e: jax.Array, top_k: int, n_group: int, topk_group: int,
                         norm_topk_prob: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's routing of float32 router logits `[n, E]`: expert scores sigmoid(logits); the experts are
    chosen on scores + `bias_e` among the `topk_group` of `n_group` groups whose best two such scores sum
    highest (the other groups' experts excluded), weighted by their unbiased scores
    (renormalised with `norm_topk_prob`), times `scaling`. Returns (expert ids, float32 weights), `[n, k]`."""
    scores_ne = jax.nn.sigmoid(logits_ne)
    choice_ne = scores_ne + bias_e
    n, e = choice_ne.shape
    if n_group > 1:
        best2_ngk, _ = jax.lax.top_k(choice_ne.reshape(n, n_group, e // n_group), 2)
        _, groups_nk = jax.lax.top_k(best2_ngk.sum(axis=-1), topk_group)
        keep_ng = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups_nk].set(True)
        choice_ne = jnp.where(jnp.repeat(keep_ng, e // n_group, axis=1), choice_ne, -jnp.inf)
    _, expert_nk = jax.lax.top_k(choice_ne, top_k)
    weight_nk = jnp.take_along_axis(scores_ne, expert_nk, axis=-1)
    if norm_topk_prob:
        weight_nk = weight_nk / (jnp.sum(weight_nk, axis=-1, keepdims=True) + 1e-20)
    return expert_nk, weight_nk * scaling


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, **kw):
        e, d, ff = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = ExpertLinear(e, d, ff, **kw)
        self.up_proj = ExpertLinear(e, d, ff, **kw)
        self.down_proj = ExpertLinear(e, ff, d, **kw)


# What a MoE layer built with moe_impl="auto" runs on a platform listed here, in place of the kernels' own pick
# (`tx.kernels.gmm.resolve_impl`). Empty in tx; the test processes list "cpu": "ragged_dot" (tests/helpers.py:
# XLA's GPU pick compiles ~7x cheaper than the CPU's loop kernel on tiny shapes).
MODEL_AUTO_IMPL: dict[str, str] = {}


class SparseMoE(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_adapters: int,
        rank: int,
        stack: tuple[int, ...],
        dtype,
        rngs: nnx.Rngs,
        moe_impl: str = "auto",
        platform: str | None = None,
        shard: LogicalSharding = NO_SHARDING,
    ):
        """`platform`: what the model's programs are built for (default: JAX's first device's, resolved here,
        not while tracing)."""
        self.platform = platform_of() if platform is None else normalise(platform)
        # the kernel is fixed when the model is built (an unknown name fails here), so the pick is part of the
        # module's static structure: two models built with different picks never share a traced program
        if moe_impl == "auto":
            moe_impl = MODEL_AUTO_IMPL.get(self.platform, "auto")
        self.moe_impl = resolve_impl(moe_impl, self.platform)
        self.shard = shard
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router, self.n_group, self.topk_group = cfg.moe_router, cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.num_adapters = num_adapters
        self.gate = Router(cfg.hidden_size, cfg.num_experts, stack=stack, dtype=dtype, rngs=rngs,
                           bias=cfg.moe_router == "sigmoid_grouped")
        self.experts = Experts(cfg, num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs)
        if cfg.n_shared_experts:  # DeepSeek-V3: an MLP every token goes through, beside the routed experts
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs,
                                      shard=shard)

    def route(self, x_nd: jax.Array, router_de: jax.Array | None = None,
              bias_e: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Top-k expert ids [..., k] and their weights [..., k] of tokens `[..., d]` (softmax in float32,
        optionally renormalised; or `sigmoid_grouped_topk`); `router_de` / `bias_e`: the router kernel and
        selection bias (default this layer's)."""
        router_de = self.gate.kernel[...] if router_de is None else router_de
        if self.router == "sigmoid_grouped":  # transformers computes these logits from float32 inputs
            bias_e = self.gate.bias(self.num_experts) if bias_e is None else bias_e
            logits_ne = jnp.dot(x_nd.astype(jnp.float32), router_de.astype(jnp.float32))
            shape = logits_ne.shape
            expert_nk, weight_nk = sigmoid_grouped_topk(
                logits_ne.reshape(-1, shape[-1]), bias_e, self.top_k, self.n_group, self.topk_group,
                self.norm_topk_prob, self.routed_scaling_factor)
            return (expert_nk.reshape(*shape[:-1], self.top_k),
                    weight_nk.reshape(*shape[:-1], self.top_k).astype(x_nd.dtype))
        logits_ne = jnp.dot(x_nd, router_de, preferred_element_type=jnp.float32)
        probs_ne = jax.nn.softmax(logits_ne, axis=-1)
        weight_nk, expert_nk = jax.lax.top_k(probs_ne, self.top_k)
        if self.norm_topk_prob:
            weight_nk = weight_nk / jnp.sum(weight_nk, axis=-1, keepdims=True)
        return expert_nk, weight_nk.astype(x_nd.dtype)

    def __call__(self, x_btd: jax.Array, adapter_b: jax.Array | None, layer: jax.Array | None = None) -> jax.Array:
        """`layer`: set when the expert kernels are the whole stack `[L, E, in, out]` (see ExpertLinear).

        Expert parallelism: on a mesh the experts run per device (`LogicalSharding.local`). Each device holds
        its rows (batch over fsdp, the same rows on every ep / tp device) and its experts' weights (experts
        over ep, the MLP width over tp, gathered over fsdp), computes its experts' share of every routed row
        of its batch, and one all-reduce over the expert and MLP axes sums the shares: no expert weight is
        gathered over ep, and the grouped matmul (a Pallas kernel on TPU) runs on local arrays."""
        b, t, d = x_btd.shape
        use_lora = adapter_b is not None
        adapter_b = adapter_b.astype(jnp.int32) if use_lora else jnp.zeros((b,), jnp.int32)
        projections = (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
        weights = [p.weights() for p in projections]
        if layer is not None and self.shard.gathers(weights[0].kernel, ("layers", "expert", *LINEAR_AXES["gate_proj"])):
            # a whole-stack kernel that is stored split over the batch's axes (fsdp) is gathered per layer, not
            # the whole stack at once: take this layer's slice first
            weights = [w._replace(kernel=jax.lax.dynamic_index_in_dim(w.kernel, layer, 0, keepdims=False))
                       for w in weights]
            layer = None
        names = [n for w, axes in zip(weights, (LINEAR_AXES[k] for k in ("gate_proj", "up_proj", "down_proj")))
                 for n in _weight_names(w, axes)]
        flat = [a for w in weights for a in w]
        expert_axis = mlp_axis = None  # mesh axes of the down kernel's [E, mlp, embed] in its compute layout
        if self.shard.mesh is not None and self.shard.mesh.size > 1:
            down_spec = self.shard.spec(names[8], flat[8].shape, taken=self.shard.batch_axes)
            expert_axis, mlp_axis = down_spec[-3], down_spec[-2]
        whole = layer is not None
        reduce = tuple(a for a in (expert_axis, mlp_axis) if a is not None)

        def run(x_btd, adapter_b, layer, router_de, bias_e, *flat):
            # routing per device too: XLA's partitioner would gather the router's probabilities for the top-k
            expert_btk, weight_btk = self.route(x_btd, router_de, bias_e)
            gate, up, down = (ExpertWeights(*flat[i:i + 4]) for i in (0, 4, 8))
            e_local = gate.kernel.shape[-3]
            offset = jax.lax.axis_index(expert_axis) * e_local if expert_axis is not None else 0
            out_btd = self._local_experts(x_btd, expert_btk - offset, weight_btk, adapter_b,
                                          layer if whole else None, (gate, up, down), use_lora, partial=bool(reduce))
            if reduce:
                out_btd = jax.lax.psum(out_btd, reduce)
            return out_btd.astype(x_btd.dtype)

        args = [x_btd, adapter_b, jnp.zeros((), jnp.int32) if layer is None else layer, self.gate.kernel[...],
                self.gate.bias(self.num_experts), *flat]
        in_names = [("batch", "length", "embed"), ("batch",), None, (None, None), (None,), *names]
        local = self.shard.local(run, in_names, ("batch", "length", "embed"), *(a.shape for a in args),
                                 out_shapes=x_btd.shape)
        out_btd = local(*args)
        if hasattr(self, "shared_experts"):
            out_btd = out_btd + self.shared_experts(x_btd, adapter_b if use_lora else None)
        return out_btd

    def _local_experts(self, x_btd, expert_btk, weight_btk, adapter_b, layer, weights, use_lora,
                       partial: bool) -> jax.Array:
        """`[b, t, d]`: the experts in `weights` (ids `0..e_local-1`; any other id in `expert_btk` belongs to
        another device and contributes nothing here) applied to the rows routed to them. `partial`: a share
        other devices' shares are added to, kept in float32 until that sum; else in the model dtype, as the
        one-device reference computes it."""
        gate, up, down = weights
        b, t, d = x_btd.shape
        k, e_local = self.top_k, gate.kernel.shape[-3]
        x_nd, expert_nk, weight_nk = x_btd.reshape(-1, d), expert_btk.reshape(-1, k), weight_btk.reshape(-1, k)
        n = x_nd.shape[0]
        if use_lora:
            slots_p, index_b = present_slots(adapter_b, self.num_adapters)
        else:
            index_b, slots_p = jnp.zeros((b,), jnp.int32), jnp.zeros((1,), jnp.int32)
        p = slots_p.shape[0]
        mine_nk = (expert_nk >= 0) & (expert_nk < e_local)
        # rows of other devices' experts sort into one trailing group that no weight owns: they come out zero
        key_nk = jnp.where(mine_nk, expert_nk * p + jnp.repeat(index_b, t)[:, None], e_local * p)
        routing = make_routing(key_nk.reshape(-1), e_local * p + 1)
        sizes_g = routing.group_sizes_g[:-1]
        rows = ExpertRows(sizes_g.reshape(e_local, p).sum(axis=1), sizes_g, slots_p,
                          jnp.repeat(adapter_b, t * k)[routing.sort_n], self.moe_impl, layer, self.platform)
        x_rd = x_nd[routing.sort_n // k]
        h_rf = (jax.nn.silu(expert_linear(x_rd, gate, rows, use_lora).astype(x_nd.dtype))
                * expert_linear(x_rd, up, rows, use_lora).astype(x_nd.dtype))
        y_rd = expert_linear(h_rf, down, rows, use_lora)
        if not partial:
            y_rd = y_rd.astype(x_nd.dtype)
        y_nkd = y_rd[routing.unsort_n].reshape(n, k, d)
        weight_nk = jnp.where(mine_nk, weight_nk, 0).astype(y_nkd.dtype)
        return jnp.sum(y_nkd * weight_nk[..., None], axis=1).reshape(b, t, d)
