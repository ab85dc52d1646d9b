"""Linear layers carrying stacked LoRA weights for every adapter slot.

Layout: `lora_a [..., A, in, R]`, `lora_b [..., A, R, out]`, `lora_scale [..., A]` (alpha / rank, or 0 where
the adapter does not train this module). The adapter axis is always third from the end, so slot
operations (init, clear, optimizer slicing) treat every LoRA weight the same way. Slot 0 stays zero: the
base model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.lora import Routing, lora_delta, make_routing

ADAPTER_AXIS = -3
_init = nnx.initializers.normal(0.02)


class LoraA(nnx.Param):
    """LoRA down-projection factor (trainable, float32)."""


class LoraB(nnx.Param):
    """LoRA up-projection factor (trainable, float32)."""


class LoraScale(nnx.Variable):
    """Per-adapter scaling alpha / rank of one module (not trained)."""


class LoraContext(NamedTuple):
    """Which adapter each token belongs to, and the token order grouped by adapter (computed once)."""

    adapter_n: jax.Array  # int32 [n]
    routing: Routing
    num_adapters: int


def make_lora_context(adapter_n: jax.Array, num_adapters: int) -> LoraContext:
    adapter_n = adapter_n.astype(jnp.int32)
    return LoraContext(adapter_n, make_routing(adapter_n, num_adapters), num_adapters)


def lora_variables(
    stack: tuple[int, ...], num_adapters: int, rank: int, in_f: int, out_f: int, experts: tuple[int, ...] = ()
) -> tuple[LoraA, LoraB, LoraScale]:
    """Zero-initialised LoRA factors `[*stack, *experts, A, in|R, R|out]` and scales `[*stack, A]`."""
    return (
        LoraA(jnp.zeros((*stack, *experts, num_adapters, in_f, rank), jnp.float32)),
        LoraB(jnp.zeros((*stack, *experts, num_adapters, rank, out_f), jnp.float32)),
        LoraScale(jnp.zeros((*stack, num_adapters), jnp.float32)),
    )


class LoRALinear(nnx.Module):
    """`y = x W + scale_a * (x A_a) B_a` where `a` is each token's adapter."""

    def __init__(
        self,
        in_f: int,
        out_f: int,
        *,
        num_adapters: int,
        rank: int,
        stack: tuple[int, ...] = (),
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.kernel = nnx.Param(_init(rngs.params(), (*stack, in_f, out_f), dtype))
        self.lora_a, self.lora_b, self.lora_scale = lora_variables(stack, num_adapters, rank, in_f, out_f)

    def __call__(self, x_bti: jax.Array, lora: LoraContext | None) -> jax.Array:
        y = jnp.dot(x_bti, self.kernel[...], preferred_element_type=jnp.float32)
        if lora is not None:
            y = y + self.delta(x_bti, lora)
        return y.astype(x_bti.dtype)

    def delta(self, x_bti: jax.Array, lora: LoraContext) -> jax.Array:
        """float32 LoRA delta with the same leading shape as x."""
        x_ni = x_bti.reshape(-1, x_bti.shape[-1])
        scale_n = self.lora_scale[...][lora.adapter_n]
        y_no = lora_delta(x_ni, lora.routing, self.lora_a[...], self.lora_b[...], scale_n)
        return y_no.reshape(*x_bti.shape[:-1], -1)
