"""Linear layers carrying stacked LoRA weights for every adapter slot.

Layout: `lora_a [..., A, in, R]`, `lora_b [..., A, R, out]`, `lora_scale [..., A]` (alpha / rank, or 0 where
the adapter does not train this module). The adapter axis is always third from the end, so slot
operations (init, clear, optimizer slicing) treat every LoRA weight the same way. Slot 0 stays zero: the
base model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tx.kernels.lora import lora_delta_rows
from tx.kernels.out_in import out_in_product
from tx.models.logical import LINEAR_AXES, NO_SHARDING, LogicalSharding

ADAPTER_AXIS = -3
_init = nnx.initializers.normal(0.02)


class LoraA(nnx.Param):
    """LoRA down-projection factor (trainable, float32)."""


class LoraB(nnx.Param):
    """LoRA up-projection factor (trainable, float32)."""


class ValueHead(LoraB):
    """A per-adapter scalar value head `[A, d, 1]` on the final hidden states (trainable, float32, zero at init):
    an RL critic's V(s). Trained, saved and cleared with the adapter's LoRA factors; only losses that read
    values (`needs_values`) give it a gradient, and the LM never reads it."""


class LoraScale(nnx.Variable):
    """Per-adapter scaling alpha / rank of one module (not trained)."""


class OutInKernel(nnx.Variable):
    """A copy of a `LoRALinear` kernel stored `[out, in]`, never a model parameter: unrolled decode keeps its
    dense kernels so on CPU (`tx.sampling.layer_copies`), read by `tx.kernels.out_in.out_in_product`."""


# the LoRALinear kernels such copies transpose: the dense layers' attention projections and MLP
OUT_IN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
        name: str | None = None,
        shard: LogicalSharding = NO_SHARDING,
    ):
        """`name`: the module's key in `LINEAR_AXES` (its logical in/out axes), with `shard` the layout its
        weights are gathered to before the matmul (no constraint without a name)."""
        self.kernel = nnx.Param(_init(rngs.params(), (*stack, in_f, out_f), dtype))
        self.lora_a, self.lora_b, self.lora_scale = lora_variables(stack, num_adapters, rank, in_f, out_f)
        self.axes = LINEAR_AXES[name] if name is not None else None
        self.shard = shard

    def __call__(self, x_bti: jax.Array, adapter_b: jax.Array | None) -> jax.Array:
        """`adapter_b` [b] picks each row's adapter; None computes the base layer only."""
        kernel, lora_a_air, lora_b_aro = self.kernel[...], self.lora_a[...], self.lora_b[...]
        out_in = isinstance(self.kernel, OutInKernel)
        if self.axes is not None:
            i, o = self.axes
            kernel = self.shard.gathered(kernel, (o, i) if out_in else (i, o))
            lora_a_air = self.shard.gathered(lora_a_air, ("adapter", i, "rank"))
            lora_b_aro = self.shard.gathered(lora_b_aro, ("adapter", "rank", o))
        if out_in:
            y_bto = out_in_product(x_bti, kernel)
        else:
            y_bto = jnp.dot(x_bti, kernel, preferred_element_type=jnp.float32)
        if adapter_b is not None:
            y_bto = y_bto + lora_delta_rows(x_bti, adapter_b, lora_a_air, lora_b_aro, self.lora_scale[...])
        return y_bto.astype(x_bti.dtype)
