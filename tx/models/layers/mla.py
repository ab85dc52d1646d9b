"""DeepSeek-V3's multi-head latent attention (MLA), with stacked multi-adapter LoRA on every projection.

Per token, `kv_a_proj_with_mqa` gives a `kv_lora_rank` latent `c` (RMS-normed) and one RoPE key `k_pe` shared
by all heads; `kv_b_proj` expands `c` into each head's key part without RoPE (`qk_nope_head_dim`) and its
value (`v_head_dim`). Queries come from `q_proj`, or through the `q_lora_rank` bottleneck `q_a_proj -> norm ->
q_b_proj`; each head's query is a part without RoPE and a RoPE part.

Two ways to compute the same attention:
- training and scoring (no cache): keys and values expanded per head, then the ordinary self-attention kernel
  (per device, like GQA attention), values zero-padded to the query/key head size and cut after;
- the paged sampling engine: the cache holds only `[c, k_pe]` per token (`kv_lora_rank + qk_rope_head_dim`
  values, what DeepSeek serves with), and `kv_b_proj` is absorbed into the queries and the output
  ("absorbed" MLA): scores `q_nope . (c W_uk_h) = (W_uk_h q_nope) . c`, so each head's query becomes
  `[W_uk_h q_nope, q_pe]` against the entries `[c, k_pe]` (one shared kv head), and its output
  `(sum_s p_s c_s) W_uv_h`. An adapter's LoRA on `kv_b_proj` (`W + s A B`) is absorbed the same way, per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx.kernels.attention import SelfAttentionMask, self_attention
from tx.kernels.paged_attention import PagedKV
from tx.models.config import ModelConfig
from tx.models.layers.attention import KV_AXES, Q_AXES, local_paged_read, local_with_local_grads
from tx.models.layers.lora import LoRALinear
from tx.models.layers.norm import RMSNorm
from tx.models.layers.rope import apply_rope, yarn_mscale
from tx.models.logical import NO_SHARDING, LogicalSharding

LATENT_POOL_AXES = ("layers", None, None, None, None)  # `[L, N, P, 1, c + rope]`: whole on every device


def deinterleave(x: jax.Array) -> jax.Array:
    """The RoPE dims of an interleaved layout (`x0 y0 x1 y1 ...`) in the half-split layout RoPE takes (`x0 x1 ...
    y0 y1 ...`), as transformers' `apply_rotary_pos_emb_interleave` views them."""
    d = x.shape[-1]
    return x[..., np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])]


class MLAttention(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs,
        shard: LogicalSharding = NO_SHARDING,
    ):
        m = cfg.mla
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.shard, self.num_heads = shard, h
        self.q_lora_rank, self.kv_lora_rank = m.q_lora_rank, m.kv_lora_rank
        self.nope, self.rope, self.v_dim, self.interleaved = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.rope_interleave
        kw = dict(num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs, shard=shard)
        qk = m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = LoRALinear(d, h * qk, name="q_proj", **kw)
        else:
            self.q_a_proj = LoRALinear(d, m.q_lora_rank, name="q_a_proj", **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, stack=stack, dtype=dtype)
            self.q_b_proj = LoRALinear(m.q_lora_rank, h * qk, name="q_b_proj", **kw)
        self.kv_a_proj_with_mqa = LoRALinear(d, m.kv_lora_rank + m.qk_rope_head_dim, name="kv_a_proj_with_mqa", **kw)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.kv_b_proj = LoRALinear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), name="kv_b_proj", **kw)
        self.o_proj = LoRALinear(h * m.v_head_dim, d, name="o_proj", **kw)
        self.scale = qk**-0.5
        yarn = cfg.yarn_rope
        if yarn is not None and yarn.mscale_all_dim:  # DeepSeek's YaRN softmax temperature, on top of cos/sin's
            self.scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2

    def _rope(self, x_bthd: jax.Array, cos_sin) -> jax.Array:
        return apply_rope(deinterleave(x_bthd) if self.interleaved else x_bthd, *cos_sin)

    def _queries(self, x_btd, cos_sin, adapter_b) -> tuple[jax.Array, jax.Array]:
        """Each head's query part without RoPE `[b, t, h, nope]` and its RoPE part `[b, t, h, rope]`."""
        b, t, _ = x_btd.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x_btd, adapter_b)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_btd, adapter_b)), adapter_b)
        q_bthq = q.reshape(b, t, self.num_heads, self.nope + self.rope)
        return q_bthq[..., :self.nope], self._rope(q_bthq[..., self.nope:], cos_sin)

    def _latent(self, x_btd, cos_sin, adapter_b) -> tuple[jax.Array, jax.Array]:
        """The normed latent `[b, t, c]` and the RoPE key `[b, t, rope]` of each token."""
        ckv_btr = self.kv_a_proj_with_mqa(x_btd, adapter_b)
        c_btc = self.kv_a_layernorm(ckv_btr[..., :self.kv_lora_rank])
        k_pe_bt1r = self._rope(ckv_btr[..., None, self.kv_lora_rank:], cos_sin)
        return c_btc, k_pe_bt1r[:, :, 0]

    def __call__(
        self,
        x_btd: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        mask: SelfAttentionMask | None,
        adapter_b: jax.Array | None,
        cache: PagedKV | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
        """Attention output [b, t, d], and None or the updated latent pool (see `Attention.__call__`)."""
        b, t, _ = x_btd.shape
        h = self.num_heads
        q_nope, q_pe = self._queries(x_btd, cos_sin, adapter_b)
        c_btc, k_pe_btr = self._latent(x_btd, cos_sin, adapter_b)
        if cache is not None:
            return self._absorbed(q_nope, q_pe, c_btc, k_pe_btr, adapter_b, cache)
        kv_bthe = self.kv_b_proj(c_btc, adapter_b).reshape(b, t, h, self.nope + self.v_dim)
        k_bthq = jnp.concatenate([kv_bthe[..., :self.nope], jnp.broadcast_to(k_pe_btr[:, :, None], (b, t, h, self.rope))
                                  .astype(kv_bthe.dtype)], axis=-1)
        q_bthq = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
        v_bthv = kv_bthe[..., self.nope:]
        width = max(self.nope + self.rope, self.v_dim)  # one head size for the kernel: zero padding adds nothing
        q_bthq, k_bthq, v_bthv = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q_bthq, k_bthq, v_bthv))
        q_bthq = self.shard.constrain(q_bthq, Q_AXES)
        k_bthq = self.shard.constrain(k_bthq, KV_AXES)
        v_bthv = self.shard.constrain(v_bthv, KV_AXES)
        kernel = functools.partial(self_attention, scale=self.scale, impl=mask.impl, platform=mask.platform)
        rows = mask.segment_ids_bt
        run = local_with_local_grads(self.shard, kernel, (Q_AXES, KV_AXES, KV_AXES, ("batch", "length")), Q_AXES,
                                     (q_bthq.shape, k_bthq.shape, v_bthv.shape, rows.shape), q_bthq.shape)
        out_bthv = run(q_bthq, k_bthq, v_bthv, rows)[..., :self.v_dim]
        return self.o_proj(out_bthv.reshape(b, t, -1), adapter_b), None

    def _kv_b(self, adapter_b):
        """`kv_b_proj` split per head: kernel `[c, h, nope + v]`, and per row its adapter's LoRA factors
        `A [b, c, R]`, `B [b, R, h, nope + v]` (scale folded into B), or None without adapters."""
        proj, h = self.kv_b_proj, self.num_heads
        kernel_che = self.shard.gathered(proj.kernel[...], (None, "heads")).reshape(self.kv_lora_rank, h, -1)
        if adapter_b is None:
            return kernel_che, None
        a_bcr = proj.lora_a[...][adapter_b]
        b_brhe = proj.lora_b[...][adapter_b] * proj.lora_scale[...][adapter_b][:, None, None]
        return kernel_che, (a_bcr, b_brhe.reshape(*b_brhe.shape[:2], h, -1))

    def _absorbed(self, q_nope, q_pe, c_btc, k_pe_btr, adapter_b, cache: PagedKV):
        """The paged engine's path: write `[c, k_pe]` into the latent pool, attend in the latent space."""
        b, t, h, _ = q_nope.shape
        f32 = jnp.float32
        cache = cache.write(jnp.concatenate([c_btc, k_pe_btr.astype(c_btc.dtype)], axis=-1)[:, :, None])
        kernel_che, lora = self._kv_b(adapter_b)
        w_uk, w_uv = kernel_che[..., :self.nope], kernel_che[..., self.nope:]
        q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w_uk, preferred_element_type=f32)
        if lora is not None:
            a_bcr, b_brhe = lora
            qb_btrh = jnp.einsum("bthn,brhn->btrh", q_nope.astype(f32), b_brhe[..., :self.nope])
            q_lat = q_lat + jnp.einsum("btrh,bcr->bthc", qb_btrh, a_bcr)
        q_bthx = jnp.concatenate([q_lat.astype(q_nope.dtype), q_pe.astype(q_nope.dtype)], axis=-1)
        q_bthx = self.shard.constrain(q_bthx, Q_AXES)
        out_lat = self._read(cache, q_bthx)[..., :self.kv_lora_rank]
        out_bthv = jnp.einsum("bthc,chv->bthv", out_lat, w_uv, preferred_element_type=f32)
        if lora is not None:
            oa_btrh = jnp.einsum("bthc,bcr->btrh", out_lat.astype(f32), a_bcr)
            out_bthv = out_bthv + jnp.einsum("btrh,brhv->bthv", oa_btrh, b_brhe[..., self.nope:])
        out_bthv = out_bthv.astype(q_nope.dtype)
        return self.o_proj(out_bthv.reshape(b, t, -1), adapter_b), cache.pools

    def _read(self, cache: PagedKV, q_bthx: jax.Array) -> jax.Array:
        """`cache.read` per device: its rows and query heads against every page's entries (one kv head, whole on
        every device). Never differentiated (sampling)."""
        return local_paged_read(self.shard, cache, q_bthx, self.scale, LATENT_POOL_AXES)
