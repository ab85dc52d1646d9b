"""Rotary position embedding (HF's half-split layout, not interleaved)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions_bt: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """float32 cos and sin, each [b, t, head_dim]."""
    inv_freq_f = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f
    angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
    return jnp.cos(angles_btd), jnp.sin(angles_btd)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    x = x_bthd.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
    return out.astype(x_bthd.dtype)
