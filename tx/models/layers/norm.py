"""RMSNorm with float32 statistics, as in HF Qwen3."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, stack: tuple[int, ...] = (), dtype: jnp.dtype = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((*stack, dim), dtype=dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the input dtype before scaling by the weight.
        return self.weight[...] * normed.astype(x.dtype)
