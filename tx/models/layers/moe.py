"""Qwen3-MoE sparse block: softmax router, top-k experts, grouped matmuls over stacked expert weights.

Token-expert rows are sorted once by `expert * A + adapter`. In that order the rows of each expert are
contiguous (base weights: E groups) and so are the rows of each (expert, adapter) pair (LoRA weights laid
out `[E, A, ...]`: E*A groups), so one sort serves both grouped matmuls.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.lora import lora_delta_grouped, make_routing
from tx.models.config import ModelConfig
from tx.models.layers.lora import lora_variables

_init = nnx.initializers.normal(0.02)


class ExpertRows(NamedTuple):
    """Rows sorted by (expert, adapter): group sizes at both granularities and each row's LoRA scale index."""

    expert_sizes_e: jax.Array  # int32 [E]
    lora_sizes_g: jax.Array  # int32 [E * A]
    adapter_r: jax.Array  # int32 [rows], sorted order


class ExpertLinear(nnx.Module):
    """`kernel [E, in, out]` plus per-expert LoRA `lora_a [E, A, in, R]`, `lora_b [E, A, R, out]`."""

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
        y_ro = jax.lax.ragged_dot(
            x_ri, self.kernel[...], rows.expert_sizes_e, preferred_element_type=jnp.float32
        )
        if use_lora:
            e, a, i, r = self.lora_a.shape
            delta_ro = lora_delta_grouped(
                x_ri,
                self.lora_a[...].reshape(e * a, i, r),
                self.lora_b[...].reshape(e * a, r, -1),
                rows.lora_sizes_g,
            )
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
        self, cfg: ModelConfig, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs
    ):
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

    def __call__(self, x_btd: jax.Array, adapter_b: jax.Array | None) -> jax.Array:
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(-1, d)
        n, k, e, a = x_nd.shape[0], self.top_k, self.num_experts, self.num_adapters
        expert_nk, weight_nk = self.route(x_nd)
        use_lora = adapter_b is not None
        adapter_n = jnp.repeat(adapter_b.astype(jnp.int32), t) if use_lora else jnp.zeros((n,), jnp.int32)
        adapter_nk = jnp.broadcast_to(adapter_n[:, None], (n, k))
        routing = make_routing((expert_nk * a + adapter_nk).reshape(-1), e * a)
        rows = ExpertRows(
            routing.group_sizes_g.reshape(e, a).sum(axis=1),
            routing.group_sizes_g,
            adapter_nk.reshape(-1)[routing.sort_n],
        )
        x_rd = x_nd[routing.sort_n // k]
        h_rf = jax.nn.silu(self.experts.gate_proj(x_rd, rows, use_lora)) * self.experts.up_proj(x_rd, rows, use_lora)
        y_rd = self.experts.down_proj(h_rf, rows, use_lora)
        y_nkd = y_rd[routing.unsort_n].reshape(n, k, d)
        out_nd = jnp.sum(y_nkd * weight_nk[..., None], axis=1)
        return out_nd.reshape(b, t, d)
