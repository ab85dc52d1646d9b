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
from tx.models.config import ModelConfig
from tx.models.layers.lora import lora_variables

_init = nnx.initializers.normal(0.02)


class ExpertRows(NamedTuple):
    """Rows sorted by (expert, present adapter): group sizes at both granularities, the present slots, each
    row's adapter slot (its LoRA scale index), and the grouped-matmul kernel."""

    expert_sizes_e: jax.Array  # int32 [E]
    lora_sizes_g: jax.Array  # int32 [E * P]
    slots_p: jax.Array  # int32 [P]: present adapter slots (unused entries repeat slot 0 and own no rows)
    adapter_r: jax.Array  # int32 [rows], sorted order
    impl: str
    layer: jax.Array | None  # int32 scalar: the layer of a scanned stack whose expert kernels are `[L, E, ...]`


def present_slots(adapter_b: jax.Array, num_adapters: int) -> tuple[jax.Array, jax.Array]:
    """The distinct slots of `adapter_b` ascending, padded with 0 to P = min(num_adapters, b), and each
    row's index among them."""
    bound = min(num_adapters, adapter_b.shape[0])
    present_a = jnp.zeros((num_adapters,), bool).at[adapter_b].set(True)
    (slots_p,) = jnp.nonzero(present_a, size=bound, fill_value=0)
    index_a = jnp.cumsum(present_a, dtype=jnp.int32) - 1
    return slots_p.astype(jnp.int32), index_a[adapter_b]


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

    def __call__(self, x_ri: jax.Array, rows: ExpertRows, use_lora: bool) -> jax.Array:
        y_ro = gmm(x_ri, self.kernel[...], rows.expert_sizes_e, impl=rows.impl, layer=rows.layer)
        if use_lora:
            a_epir = self.lora_a[...][:, rows.slots_p]
            e, p, i, r = a_epir.shape
            b_gro = self.lora_b[...][:, rows.slots_p].reshape(e * p, r, -1)
            h_rr = gmm(x_ri.astype(a_epir.dtype), a_epir.reshape(e * p, i, r), rows.lora_sizes_g, impl=rows.impl)
            delta_ro = gmm(h_rr, b_gro, rows.lora_sizes_g, impl=rows.impl)
            y_ro = y_ro + delta_ro * self.lora_scale[...][rows.adapter_r][:, None]
        return y_ro.astype(x_ri.dtype)


class Router(nnx.Module):
    def __init__(self, d: int, num_experts: int, *, stack: tuple[int, ...], dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs.params(), (*stack, d, num_experts), dtype))


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, **kw):
        e, d, ff = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = ExpertLinear(e, d, ff, **kw)
        self.up_proj = ExpertLinear(e, d, ff, **kw)
        self.down_proj = ExpertLinear(e, ff, d, **kw)


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
    ):
        resolve_impl(moe_impl)  # an unknown name fails when the model is built
        self.moe_impl = moe_impl
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_adapters = num_adapters
        self.gate = Router(cfg.hidden_size, cfg.num_experts, stack=stack, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs)

    def route(self, x_nd: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Top-k expert ids [n, k] and their weights [n, k] (softmax in float32, optionally renormalised)."""
        logits_ne = jnp.dot(x_nd, self.gate.kernel[...], preferred_element_type=jnp.float32)
        probs_ne = jax.nn.softmax(logits_ne, axis=-1)
        weight_nk, expert_nk = jax.lax.top_k(probs_ne, self.top_k)
        if self.norm_topk_prob:
            weight_nk = weight_nk / jnp.sum(weight_nk, axis=-1, keepdims=True)
        return expert_nk, weight_nk.astype(x_nd.dtype)

    def __call__(self, x_btd: jax.Array, adapter_b: jax.Array | None, layer: jax.Array | None = None) -> jax.Array:
        """`layer`: set when the expert kernels are the whole stack `[L, E, in, out]` (see ExpertLinear)."""
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(-1, d)
        n, k, e = x_nd.shape[0], self.top_k, self.num_experts
        expert_nk, weight_nk = self.route(x_nd)
        use_lora = adapter_b is not None
        if use_lora:
            adapter_b = adapter_b.astype(jnp.int32)
            slots_p, index_b = present_slots(adapter_b, self.num_adapters)
        else:
            adapter_b = index_b = jnp.zeros((b,), jnp.int32)
            slots_p = jnp.zeros((1,), jnp.int32)
        p = slots_p.shape[0]
        key_nk = expert_nk * p + jnp.repeat(index_b, t)[:, None]
        routing = make_routing(key_nk.reshape(-1), e * p)
        rows = ExpertRows(
            routing.group_sizes_g.reshape(e, p).sum(axis=1),
            routing.group_sizes_g,
            slots_p,
            jnp.repeat(adapter_b, t * k)[routing.sort_n],
            self.moe_impl,
            layer,
        )
        x_rd = x_nd[routing.sort_n // k]
        h_rf = jax.nn.silu(self.experts.gate_proj(x_rd, rows, use_lora)) * self.experts.up_proj(x_rd, rows, use_lora)
        y_rd = self.experts.down_proj(h_rf, rows, use_lora)
        y_nkd = y_rd[routing.unsort_n].reshape(n, k, d)
        out_nd = jnp.sum(y_nkd * weight_nk[..., None], axis=1)
        return out_nd.reshape(b, t, d)
