"""The token embedding and the LM head (`h W`, W the embedding's transpose when tied) with its per-adapter
LoRA delta and value head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.lora import add_lora_head_delta
from tx.kernels.out_in import out_in_product
from tx.models.config import LoraSlots
from tx.models.layers.lora import ValueHead, lora_variables
from tx.models.logical import NO_SHARDING, LogicalSharding

_init = nnx.initializers.normal(0.02)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, d: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(_init(rngs.params(), (vocab, d), dtype))

    def __call__(self, ids_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids_bt, axis=0)


class LMHead(nnx.Module):
    """Unembedding `h W` (W = embedding^T when tied) plus a per-adapter LoRA delta."""

    def __init__(self, d: int, vocab: int, *, tied: bool, dtype, slots: LoraSlots, rngs: nnx.Rngs,
                 shard: LogicalSharding = NO_SHARDING):
        self.shard = shard
        self.kernel = None if tied else nnx.Param(_init(rngs.params(), (d, vocab), dtype))
        self.lora_a, self.lora_b, self.lora_scale = lora_variables(
            (), slots.max_lora_adapters, slots.max_lora_rank, d, vocab
        )
        self.value_head = ValueHead(jnp.zeros((slots.max_lora_adapters, d, 1), jnp.float32))

    def weight(self, embedding_vd: jax.Array) -> jax.Array:
        """W [d, vocab] of `h W` (the embedding's transpose when tied), gathered to the matmul's layout."""
        w_dv = embedding_vd.T if self.kernel is None else self.kernel[...]
        return self.shard.gathered(w_dv, ("embed", "vocab"))

    def __call__(self, h_btd: jax.Array, embedding_vd: jax.Array, adapter_b: jax.Array | None,
                 kernel_vd: jax.Array | None = None) -> jax.Array:
        """float32 logits [b, t, vocab]. `kernel_vd`: a copy of the untied kernel stored `[vocab, d]` (decode's on
        CPU, `tx.sampling.layer_copies`), read instead of the kernel."""
        if kernel_vd is None:
            logits_btv = jnp.dot(h_btd, self.weight(embedding_vd), preferred_element_type=jnp.float32)
        else:
            kernel_vd = self.shard.gathered(kernel_vd, ("vocab", "embed"))
            logits_btv = out_in_product(h_btd, kernel_vd)
        logits_btv = self.shard.constrain(logits_btv, ("batch", "length", "vocab"))
        if adapter_b is not None:
            logits_btv = add_lora_head_delta(  # in place, vocab block by block: no per-row B
                logits_btv, h_btd, adapter_b, self.shard.gathered(self.lora_a[...], ("adapter", "embed", "rank")),
                self.shard.gathered(self.lora_b[...], ("adapter", "rank", "vocab")), self.lora_scale[...]
            )
        return logits_btv
