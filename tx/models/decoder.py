"""The decoder every built-in family runs on (`DecoderLM`), in flax nnx, with stacked multi-adapter LoRA and
scanned layers. Which layers it holds follows the `ModelConfig` (the family's config mapping): attention is
grouped-query (`layers.attention`, with Qwen3's per-head q/k norms or without, as Llama) or multi-head latent
(`layers.mla`, DeepSeek-V3); the feed-forward block a SwiGLU MLP or a sparse MoE (`layers.moe`: softmax top-k as
Qwen3-MoE, or DeepSeek-V3's grouped sigmoid routing with shared experts); RoPE default, Llama 3.1's or YaRN.
`tx.models.family.CausalLM` states what the rest of tx calls on it.

Consecutive decoder layers of the same kind (dense MLP or sparse MoE) form one `DecoderStack` whose
weights carry a leading layer axis and run under `jax.lax.scan`; a model whose MoE layers are
interleaved with dense ones (`decoder_sparse_step`, `mlp_only_layers`, `first_k_dense_replace`) simply has
several stacks. The model returns final hidden states; `target_logprobs` turns them into float32 log-probs in
chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.attention import resolve_attention_impl, self_attention_mask
from tx.kernels.paged_attention import PagedKV
from tx.kernels.platform import normalise, platform_of
from tx.kernels.row_groups import group_count, map_row_groups
from tx.kernels.shared_prefix import SharedPrefix
from tx.models.config import LoraSlots, ModelConfig
from tx.models.layers.attention import Attention
from tx.models.layers.embedding import Embedding, LMHead
from tx.models.layers.mla import MLAttention
from tx.models.layers.mlp import MLP
from tx.models.layers.moe import SparseMoE
from tx.models.layers.norm import RMSNorm
from tx.models.layers.rope import rope_cos_sin
from tx.models.logical import NO_SHARDING, LogicalSharding
from tx.models.logprobs import chunked_target_logprobs, frozen_head_target_logprobs

# What a layer keeps for the backward pass under gradient checkpointing (`remat_policy`); "none" = no remat.
# "layer" keeps only each layer's input: least memory (≈ tokens × hidden per layer), one extra forward.
# "dots_saveable" keeps every matmul output: little recompute, memory ≈ tokens × (all projection widths).
REMAT_POLICIES = {
    "none": None,
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Without gradient checkpointing ("none") a dense layer still runs under this policy: it keeps the output of
# every matmul with a weight (dots without batch dimensions) and recomputes in the backward pass only what lies
# between them (norms, activations, RoPE, casts, the rank-sized LoRA products, attention), never a weight matmul.
# Keeping everything instead stacked every intermediate of every layer for the scan's backward: at bench_peer's
# ~100M shape (8 x 128 tokens, CPU) a forward-backward took 2.95 s against 2.1-2.4 s, peak RSS 2.05 against
# 1.58 GB; one 4,096-token row: the same time, 4.0 against 2.5 GB. MoE layers keep everything: their expert
# matmuls are grouped kernels, not dots, and would be recomputed.
NO_RECOMPUTE_DENSE = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


# Sampling prefill runs thousands of tokens a call through each layer. On CPU, XLA's GEMMs run an MLP over
# 4,096 tokens ~14% faster as four groups of 1,024 in turn (their [tokens, intermediate] products stay in
# cache) than at once (bench_peer's shape, docs/performance.md); a row's products are the same bits either way.
# One device only: not measured where the rows are sharded.
PAGED_MLP_TOKENS = {"cpu": 1024}


def remat_policy(name: str):
    """The `jax.checkpoint` policy called `name` (None for "none")."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={name!r} is not one of {', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


class DecoderLayer(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, moe: bool, stack: tuple[int, ...], dtype, slots: LoraSlots, moe_impl: str,
        platform: str, rngs, shard: LogicalSharding = NO_SHARDING,
    ):
        self.shard = shard
        self.moe = moe
        kw = dict(num_adapters=slots.max_lora_adapters, rank=slots.max_lora_rank, stack=stack, dtype=dtype, rngs=rngs,
                  shard=shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.self_attn = Attention(cfg, **kw) if cfg.mla is None else MLAttention(cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.mlp = (SparseMoE(cfg, moe_impl=moe_impl, platform=platform, **kw) if moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, **kw))
        self.platform = platform

    def __call__(self, x_btd, cos_sin, mask_bts, adapter_b: jax.Array | None, cache=None, layer=None):
        x_btd = self.shard.constrain(x_btd, ("batch", "length", "embed"))  # the block boundary
        attn_btd, kv = self.self_attn(self.input_layernorm(x_btd), cos_sin, mask_bts, adapter_b, cache)
        x_btd = x_btd + attn_btd
        mlp_in_btd = self.post_attention_layernorm(x_btd)
        if layer is not None:
            mlp_btd = self.mlp(mlp_in_btd, adapter_b, layer)
        else:
            b, t, _ = x_btd.shape
            grouped = cache is not None and self.shard.one_device and not self.moe
            most = PAGED_MLP_TOKENS.get(self.platform) if grouped else None
            mlp_btd = map_row_groups(self.mlp, (mlp_in_btd, adapter_b), group_count(b, t, most))
        return self.shard.constrain(x_btd + mlp_btd, ("batch", "length", "embed")), kv


def _is_expert_kernel(path, _value) -> bool:
    return len(path) >= 2 and path[-1] == "kernel" and "experts" in path


class DecoderStack(nnx.Module):
    """Consecutive layers of one kind, weights stacked on a leading axis, applied with `lax.scan`."""

    def __init__(
        self, cfg: ModelConfig, layer_ids: tuple[int, ...], *, moe: bool, remat_policy: str, experts_whole: bool = True,
        **kw,
    ):
        self.layer_ids = layer_ids
        self.moe = moe
        self.experts_whole = experts_whole
        self.remat_policy = remat_policy
        self.layer = DecoderLayer(cfg, moe=moe, stack=(len(layer_ids),), **kw)

    def _split(self):
        """(graphdef, the whole expert kernels or None, the state scanned over layers)."""
        # MoE expert kernels stay whole ([L, E, in, out], closed over) and each step passes its layer index:
        # scanning over them would copy every layer's expert slice (GBs per layer at real shapes).
        # When the expert kernels are trained (full fine-tuning) they are scanned like every other weight:
        # a closed-over whole kernel would get a whole-stack-sized gradient per layer in the backward pass.
        if self.moe and self.experts_whole:
            return nnx.split(self.layer, _is_expert_kernel, ...)
        graphdef, state = nnx.split(self.layer)
        return graphdef, None, state

    def scanned_state(self):
        """The state `lax.scan` slices per layer (every weight stacked on a leading layer axis; MoE expert
        kernels kept whole are not in it). Unrolled decode (tx/sampling/layer_copies.py) copies it out one
        layer at a time: under the scan every decode step slices every layer's weights out of the stack
        again (a copy per weight, layer and step on CPU, and on GPU where a matmul cannot read the slice in
        place)."""
        return self._split()[2]

    def layer_bytes(self) -> int:
        """Bytes of the scanned state on one device: what unrolled decode copies."""
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(self.scanned_state()))

    def __call__(self, x_btd, cos_sin, mask_bts, adapter_b: jax.Array | None, paged: PagedKV | None = None,
                 layers: list | None = None, last_at_b: jax.Array | None = None):
        """Hidden states, and None; or, given the sampling engine's `PagedKV`, the updated page pools, where
        `layers` (one `scanned_state()` per layer) runs the layers one by one on those arrays, and `last_at_b`
        (paged only) asks for the hidden state `[b, 1, d]` of one token a row (`_paged`)."""
        graphdef, whole, state = self._split()
        layer_l = jnp.arange(len(self.layer_ids), dtype=jnp.int32)
        if paged is not None:
            return self._paged(graphdef, whole, state, layer_l, x_btd, cos_sin, adapter_b, paged, layers, last_at_b)
        if last_at_b is not None:
            raise ValueError("last_at_b selects tokens of a paged call only")

        def body(h_btd, xs):
            layer_state, layer = xs
            if whole is None:
                h_btd, _ = nnx.merge(graphdef, layer_state)(h_btd, cos_sin, mask_bts, adapter_b)
            else:
                h_btd, _ = nnx.merge(graphdef, whole, layer_state)(h_btd, cos_sin, mask_bts, adapter_b, None, layer)
            return h_btd, None

        policy = remat_policy(self.remat_policy)
        if policy is None and not self.moe:
            policy = NO_RECOMPUTE_DENSE
        if policy is not None:  # per-layer gradient checkpointing: the policy says what the backward may keep
            body = jax.checkpoint(body, policy=policy)
        h_btd, _ = jax.lax.scan(body, x_btd, (state, layer_l))
        return h_btd, None

    def _paged(self, graphdef, whole, state, layer_l, x_btd, cos_sin, adapter_b, paged: PagedKV, layers,
               last_at_b: jax.Array | None = None):
        """Sampling-engine mode: the stack's page pools ride in the scan carry and each layer scatters its
        keys/values into them at its own index (no per-layer copy of the cache; in place when donated).
        With `layers`, a Python loop over them instead of the scan (the same body); in a call of more than one
        token a row (prefill) each layer's weights pass an optimization barrier with the previous layer's
        output, so XLA runs the layers in turn: unordered, the unrolled program held several layers' activations
        at once (a 4,096-token call at a 100M shape: 387 MB of temporaries, 259 MB ordered, 134 MB scanned)
        and ran slower (bench_peer's batch 8 on CPU: 0.977x the scan's call time unordered, 0.952x ordered).
        `last_at_b` (int32 `[b]`): the output is the hidden state of token `last_at_b[i]` of each row only
        (`[b, 1, d]`, what a prefill call keeps of a prompt's last token): every token still writes its keys and
        values in every layer, and the last layer then runs once more on those tokens alone, writing nothing.
        Unrolled, its first run's other outputs are dead code XLA drops, so past their keys/values the other
        tokens cost nothing in the last layer; under the scan every layer runs its whole body, as before, and the
        rerun slices the last layer's weights out of the stacks once."""

        def body(carry, xs):
            h_btd, *pools = carry
            layer_state, layer = xs
            kv = paged.with_pools(tuple(pools), layer)
            if whole is None:
                h_btd, pools = nnx.merge(graphdef, layer_state)(h_btd, cos_sin, None, adapter_b, kv)
            else:
                h_btd, pools = nnx.merge(graphdef, whole, layer_state)(h_btd, cos_sin, None, adapter_b, kv, layer)
            return (h_btd, *pools), None

        def last_only(h_btd, pools, layer_state):  # the last layer once more, on row i's token last_at_b[i]
            def pick(x):
                return jnp.take_along_axis(x, last_at_b.reshape(-1, 1, *(1,) * (x.ndim - 2)), axis=1)

            kv = dataclasses.replace(paged.with_pools(tuple(pools), layer_l[-1]), pos_bt=pick(paged.pos_bt),
                                     valid_bt=jnp.zeros((h_btd.shape[0], 1), bool))
            layer = nnx.merge(graphdef, layer_state) if whole is None else nnx.merge(graphdef, whole, layer_state)
            args = (pick(h_btd), jax.tree.map(pick, cos_sin), None, adapter_b, kv)
            # its pools are what it wrote (the trash page only): the ones before, kept too, would cost a copy
            h_b1d, pools = layer(*args) if whole is None else layer(*args, layer_l[-1])
            return h_b1d, tuple(pools)

        carry = (x_btd, *paged.pools)
        if layers is None:
            if last_at_b is None:
                carry, _ = jax.lax.scan(body, carry, (state, layer_l))
            else:  # the last layer's input kept: the scan carries each layer's input beside its output
                def body_keeping_input(c, xs):
                    out, _ = body(c[1:], xs)
                    return (c[1], *out), None

                (last_in_btd, *carry), _ = jax.lax.scan(body_keeping_input, (x_btd, *carry), (state, layer_l))
                _, *pools = carry
                return last_only(last_in_btd, pools, jax.tree.map(lambda x: x[-1], state))
        else:
            for i, layer_state in enumerate(layers):
                if x_btd.shape[1] > 1:
                    carry, layer_state = jax.lax.optimization_barrier((carry, layer_state))
                last_in_btd = carry[0]
                carry, _ = body(carry, (layer_state, jnp.int32(i)))
            if last_at_b is not None:
                _, *pools = carry
                return last_only(last_in_btd, pools, layers[-1])
        h_btd, *pools = carry
        return h_btd, tuple(pools)


def layer_groups(cfg: ModelConfig) -> list[tuple[bool, tuple[int, ...]]]:
    """Runs of consecutive layers of the same kind: [(is_moe, layer ids), ...]."""
    kinds = [(cfg.is_moe_layer(i), i) for i in range(cfg.num_hidden_layers)]
    return [(moe, tuple(i for _, i in run)) for moe, run in itertools.groupby(kinds, key=lambda x: x[0])]


class DecoderLM(nnx.Module):
    """A causal decoder of any built-in family (Qwen3 / Qwen3-MoE / Llama 3 / DeepSeek-V3, by its config) with
    `max_lora_adapters` LoRA slots on every attention projection, MLP or expert, and the LM head."""

    def __init__(
        self,
        cfg: ModelConfig,
        slots: LoraSlots,
        *,
        dtype: jnp.dtype | None = None,
        remat_policy: str = "none",
        attention_impl: str = "auto",
        moe_impl: str = "auto",
        experts_whole: bool = True,
        platform: str | None = None,
        sharding: LogicalSharding = NO_SHARDING,
        rngs: nnx.Rngs,
    ):
        """`experts_whole=False` scans MoE expert kernels per layer (for training them; see DecoderStack).
        `platform`: what the model's programs are built for ("cpu", "cuda", "tpu"; `tx.kernels.platform`),
        which picks the "auto" kernels and whether Pallas TPU kernels are compiled; default JAX's first
        device's, resolved here (loaders pass their mesh's). `sharding`: the logical-axis rules on the mesh
        (`tx.models.logical`) that the layers' activation constraints follow (loaders pass theirs)."""
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.config = cfg
        self.slots = slots
        self.layout = sharding  # the logical-axis rules on the mesh (also for the caches callers allocate)
        self.platform = platform_of() if platform is None else normalise(platform)
        resolve_attention_impl(attention_impl, self.platform)  # an unknown name fails here, not at the first call
        self.attention_impl = attention_impl
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.stacks = nnx.List(
            [
                DecoderStack(
                    cfg, ids, moe=moe, remat_policy=remat_policy, experts_whole=experts_whole, dtype=dtype,
                    slots=slots, moe_impl=moe_impl, platform=self.platform, rngs=rngs, shard=sharding,
                )
                for moe, ids in layer_groups(cfg)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = LMHead(
            cfg.hidden_size, cfg.vocab_size, tied=cfg.tie_word_embeddings, dtype=dtype, slots=slots, rngs=rngs,
            shard=sharding,
        )

    def __call__(
        self,
        input_ids_bt: jax.Array,
        attention_mask_bt: jax.Array,
        adapter_indices_b: jax.Array | None = None,
        positions_bt: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
    ) -> jax.Array:
        """Final (normed) hidden states [b, t, d]. Padding is on the right; padded positions are garbage."""
        b, t = input_ids_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = self_attention_mask(attention_mask_bt, segment_ids_bt, self.attention_impl, self.platform)
        hidden_btd, _ = self._layers(input_ids_bt, positions_bt, mask, adapter_indices_b)
        return hidden_btd

    def paged_forward(
        self,
        ids_bt: jax.Array,
        positions_bt: jax.Array,
        valid_bt: jax.Array,
        adapter_indices_b: jax.Array | None,
        pools: list[tuple[jax.Array, ...]],
        table_bw: jax.Array,
        impl: str = "blocked",
        kv_block: int = 128,
        kv_blocks: int | None = None,
        layers: list | None = None,
        prefix: SharedPrefix | None = None,
        last_at_r: jax.Array | None = None,
    ) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
        """Tokens at `positions_bt` of sequences whose KV pages are `table_bw` (a prefill chunk, or one
        decode token per row): each stack writes their keys/values into its page pools (`kv_layout`: keys and
        values `[L, N, P, kv, d]`, or one latent pool `[L, N, P, 1, c]`)
        and attends over the sequences' pages (`kv_blocks`: see `paged_attention`). `layers` (per stack,
        its `scanned_state()` one layer at a time): run the layers one by one on those arrays. `prefix`
        (decode): pages rows share, read once per segment of rows (`PagedKV.prefix`). Returns final
        hidden states `[b, t, d]` and the pools; with `last_at_r` (int32 `[b]`), only those of token
        `last_at_r[i]` of each row, `[b, 1, d]` (`DecoderStack._paged`)."""
        paged = [PagedKV(pool[0], pool[1] if len(pool) > 1 else None, jnp.int32(0), table_bw, positions_bt, valid_bt,
                         impl, kv_block, self.platform, kv_blocks, prefix) for pool in pools]
        return self._layers(ids_bt, positions_bt, None, adapter_indices_b, paged, layers, last_at_r)

    def kv_layout(self) -> tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]:
        """What the paged cache holds per token and layer: per pool, its entry's shape and logical axes. Keys
        and values `[kv_heads, head_dim]` each; with latent attention one pool of the compressed latent and
        the RoPE key, `[1, kv_lora_rank + qk_rope_head_dim]` (its leading part doubles as the values)."""
        cfg = self.config
        if cfg.mla is not None:
            return (((1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), (None, None)),)
        kv = ((cfg.num_key_value_heads, cfg.head_dim), ("kv_heads", "head_dim"))
        return (kv, kv)

    def kv_bytes_per_token(self) -> int:
        """Bytes the paged cache holds per token over every layer (the model's dtype)."""
        entry = sum(math.prod(shape) for shape, _ in self.kv_layout())
        return self.config.num_hidden_layers * entry * jnp.dtype(self.embed_tokens.embedding.get_value().dtype).itemsize

    def scanned_states(self) -> list:
        """Each stack's `DecoderStack.scanned_state()`."""
        return [stack.scanned_state() for stack in self.stacks]

    def layer_bytes(self) -> int:
        """The scanned states' bytes on one device (what unrolled decode copies)."""
        return sum(stack.layer_bytes() for stack in self.stacks)

    def _layers(self, ids_bt, positions_bt, mask, adapter_b, paged: list | None = None, layers=None, last_at_b=None):
        """Final hidden states and, per stack, None or (given each stack's `PagedKV` in `paged`) its pools."""
        cfg = self.config
        llama3 = cfg.llama3_rope and (cfg.llama3_rope.factor, cfg.llama3_rope.low_freq_factor,
                                      cfg.llama3_rope.high_freq_factor, cfg.llama3_rope.original_max_position_embeddings)
        cos_sin = rope_cos_sin(positions_bt, cfg.head_dim, cfg.rope_theta, llama3,
                               cfg.yarn_rope.key() if cfg.yarn_rope else None)
        x_btd = self.embed_tokens(ids_bt)
        kvs = []
        for i, stack in enumerate(self.stacks):
            last = i == len(self.stacks) - 1
            x_btd, kv = stack(x_btd, cos_sin, mask, adapter_b, None if paged is None else paged[i],
                              None if layers is None else layers[i], last_at_b if last else None)
            kvs.append(kv)
        return self.norm(x_btd), kvs

    def logits(self, h_btd: jax.Array, adapter_indices_b: jax.Array | None,
               head_vd: jax.Array | None = None) -> jax.Array:
        """float32 logits [b, t, vocab] (small t: sampling, tests; training uses `target_logprobs`). `head_vd`: the
        untied LM head's kernel as a `[vocab, d]` copy (`LMHead`)."""
        return self.lm_head(h_btd, self.embed_tokens.embedding[...], adapter_indices_b, head_vd)

    def head_kernel(self) -> jax.Array | None:
        """The untied LM head's kernel `[d, vocab]`; None when the head is the embedding (tied)."""
        return None if self.lm_head.kernel is None else self.lm_head.kernel[...]

    def head_lora_scale(self) -> jax.Array:
        """float32 [A]: each adapter slot's LM-head LoRA scale (0 where the slot does not train the head, whose
        delta is then exactly zero: passes over such slots skip it)."""
        return self.lm_head.lora_scale[...]

    def values(self, hidden_btd: jax.Array, adapter_indices_b: jax.Array) -> jax.Array:
        """float32 V [b, t]: each row's adapter's value head on the final hidden states."""
        w_bd = self.lm_head.value_head[...][adapter_indices_b, :, 0]
        return jnp.einsum("btd,bd->bt", hidden_btd.astype(jnp.float32), w_bd)

    def target_logprobs(
        self,
        hidden_btd: jax.Array,
        targets_bt: jax.Array,
        adapter_indices_b: jax.Array | None = None,
        chunk_size: int = 1024,
        with_entropy: bool = False,
        temperature_b: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """float32 log p(target) [b, t], computed `chunk_size` tokens at a time (no [b, t, vocab] tensor);
        with `with_entropy`, also each position's entropy [b, t]; with `temperature_b` [b], of each row's
        softmax(logits / temperature)."""
        if adapter_indices_b is None and not with_entropy:  # the head is frozen here unless its weight trains
            return frozen_head_target_logprobs(hidden_btd, self.lm_head.weight(self.embed_tokens.embedding[...]),
                                               targets_bt, temperature_b, chunk_size)
        logits_fn = self.logits
        if temperature_b is not None:
            def logits_fn(h_btd, adapter_b):
                return self.logits(h_btd, adapter_b) / temperature_b.astype(jnp.float32)[:, None, None]
        return chunked_target_logprobs(logits_fn, hidden_btd, targets_bt, adapter_indices_b, chunk_size,
                                       with_entropy)
