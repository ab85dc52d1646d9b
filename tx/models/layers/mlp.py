"""SwiGLU feed-forward block."""

from __future__ import annotations

import jax
from flax import nnx

from tx.models.layers.lora import LoRALinear


class MLP(nnx.Module):
    def __init__(
        self, d: int, ff: int, *, num_adapters: int, rank: int, stack: tuple[int, ...], dtype, rngs: nnx.Rngs
    ):
        kw = dict(num_adapters=num_adapters, rank=rank, stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj = LoRALinear(d, ff, **kw)
        self.up_proj = LoRALinear(d, ff, **kw)
        self.down_proj = LoRALinear(ff, d, **kw)

    def __call__(self, x_btd: jax.Array, adapter_b: jax.Array | None) -> jax.Array:
        h_btf = jax.nn.silu(self.gate_proj(x_btd, adapter_b)) * self.up_proj(x_btd, adapter_b)
        return self.down_proj(h_btf, adapter_b)
