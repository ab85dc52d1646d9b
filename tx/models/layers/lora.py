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
    dense kernels so on CPU (`tx.sampling.layer_copies`), read by `tx.kernels.out_in.out_in_product`. A copy
    with metadata `parts` (each module's out width) holds a whole `FUSED_GROUPS` group's kernels stacked along
    `out`, on the group's first module (the others hold an empty placeholder); `grouped` reads it."""


# the LoRALinear kernels such copies transpose: the dense layers' attention projections and MLP
OUT_IN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# sibling modules of one input whose copies are one `[sum of out, in]` kernel: one product reads them in one
# pass (one row on a 2-core CPU: ~10% faster for q/k/v and for gate/up than their separate products)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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
        return self.plus_delta(self.product(x_bti), x_bti, adapter_b)

    def product(self, x_bti: jax.Array) -> jax.Array:
        """float32 `x kernel` (the whole group's where the kernel is a fused copy), in its compute layout."""
        w = self.kernel[...]
        out_in = isinstance(self.kernel, OutInKernel)
        if self.axes is not None:
            i, o = self.axes
            w = self.shard.gathered(w, (o, i) if out_in else (i, o))
        if out_in:
            return out_in_product(x_bti, w)
        return jnp.dot(x_bti, w, preferred_element_type=jnp.float32)

    def plus_delta(self, y_bto: jax.Array, x_bti: jax.Array, adapter_b: jax.Array | None) -> jax.Array:
        """`y_bto` plus each row's LoRA delta (None: none), in `x_bti`'s dtype."""
        if adapter_b is not None:
            lora_a_air, lora_b_aro = self.lora_a[...], self.lora_b[...]
            if self.axes is not None:
                i, o = self.axes
                lora_a_air = self.shard.gathered(lora_a_air, ("adapter", i, "rank"))
                lora_b_aro = self.shard.gathered(lora_b_aro, ("adapter", "rank", o))
            y_bto = y_bto + lora_delta_rows(x_bti, adapter_b, lora_a_air, lora_b_aro, self.lora_scale[...])
        return y_bto.astype(x_bti.dtype)


def grouped(modules: tuple[LoRALinear, ...], x_bti: jax.Array, adapter_b: jax.Array | None) -> list[jax.Array]:
    """Each of `modules`' outputs (a `FUSED_GROUPS` group, in its order) for the same input: one product where
    the first holds the group's fused copy (`OutInKernel` with `parts`), split, plus each module's delta."""
    parts = getattr(modules[0].kernel, "parts", None)
    if parts is None:
        return [module(x_bti, adapter_b) for module in modules]
    y_bto = modules[0].product(x_bti)
    starts = [sum(parts[:j]) for j in range(len(parts))]
    return [module.plus_delta(y_bto[..., start : start + width], x_bti, adapter_b)
            for module, start, width in zip(modules, starts, parts)]
