"""Qwen3 grouped-query self-attention with per-head q/k RMSNorm and RoPE."""

from __future__ import annotations

import jax
from flax import nnx

from tx.kernels.attention import SelfAttentionMask, attention, self_attention
from tx.kernels.paged_attention import PagedKV
from tx.models.config import ModelConfig
from tx.models.layers.lora import LoRALinear
from tx.models.layers.norm import RMSNorm
from tx.models.layers.rope import apply_rope


class Attention(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs
    ):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        kw = dict(num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs)
        self.q_proj = LoRALinear(d, self.num_heads * hd, **kw)
        self.k_proj = LoRALinear(d, self.num_kv_heads * hd, **kw)
        self.v_proj = LoRALinear(d, self.num_kv_heads * hd, **kw)
        self.o_proj = LoRALinear(self.num_heads * hd, d, **kw)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, stack=stack, dtype=dtype)

    def __call__(
        self,
        x_btd: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        mask: SelfAttentionMask | jax.Array,
        adapter_b: jax.Array | None,
        cache: tuple[jax.Array, jax.Array, jax.Array] | PagedKV | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention output [b, t, d] and keys/values.

        Without `cache`, queries attend over this call's own keys (training, prefill) with the kernel and
        segment ids of `mask` (a `SelfAttentionMask`), and the returned keys/values are this call's
        `[b, t, kv, d]`. With `cache = (k_bskd, v_bskd, write_pos_b)` (decode), this call's keys/values are
        written into the cache at each row's position, queries attend over the whole cache under the dense
        `[b, t, s]` bool `mask` (reference kernel), and the updated cache is returned. With a `PagedKV`
        (the sampling engine), they are written into its pages and queries attend over their sequences'
        pages (`mask` unused); the updated pools are returned."""
        b, t, _ = x_btd.shape
        q_bthd = self.q_norm(self.q_proj(x_btd, adapter_b).reshape(b, t, self.num_heads, self.head_dim))
        k_btkd = self.k_norm(self.k_proj(x_btd, adapter_b).reshape(b, t, self.num_kv_heads, self.head_dim))
        v_btkd = self.v_proj(x_btd, adapter_b).reshape(b, t, self.num_kv_heads, self.head_dim)
        q_bthd, k_btkd = apply_rope(q_bthd, *cos_sin), apply_rope(k_btkd, *cos_sin)
        scale = self.head_dim**-0.5
        if isinstance(cache, PagedKV):
            out_bthd, pools = cache.attend(q_bthd, k_btkd, v_btkd, scale)
            return self.o_proj(out_bthd.reshape(b, t, -1), adapter_b), pools
        if cache is not None:
            k_cache, v_cache, write_pos_b = cache
            write = jax.vmap(lambda c, new, p: jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (p, 0, 0)))
            k_btkd, v_btkd = write(k_cache, k_btkd, write_pos_b), write(v_cache, v_btkd, write_pos_b)
        if isinstance(mask, SelfAttentionMask):
            out_bthd = self_attention(q_bthd, k_btkd, v_btkd, mask.segment_ids_bt, scale, mask.impl)
        else:
            out_bthd = attention(q_bthd, k_btkd, v_btkd, mask, scale)
        return self.o_proj(out_bthd.reshape(b, t, -1), adapter_b), (k_btkd, v_btkd)
