"""SwiGLU feed-forward block."""

from __future__ import annotations

import jax
from flax import nnx

from tx.models.layers.lora import LoRALinear, grouped
from tx.models.logical import NO_SHARDING, LogicalSharding


class MLP(nnx.Module):
    def __init__(
        self, d: int, ff: int, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs,
        shard: LogicalSharding = NO_SHARDING,
    ):
        self.shard = shard
        kw = dict(num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs, shard=shard)
        self.gate_proj = LoRALinear(d, ff, name="gate_proj", **kw)
        self.up_proj = LoRALinear(d, ff, name="up_proj", **kw)
        self.down_proj = LoRALinear(ff, d, name="down_proj", **kw)

    def __call__(self, x_btd: jax.Array, adapter_b: jax.Array | None) -> jax.Array:
        gate_btf, up_btf = grouped((self.gate_proj, self.up_proj), x_btd, adapter_b)
        h_btf = jax.nn.silu(gate_btf) * up_btf
        h_btf = self.shard.constrain(h_btf, ("batch", "length", "mlp"))
        return self.down_proj(h_btf, adapter_b)
