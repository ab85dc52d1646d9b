"""Rotary position embedding (HF's half-split layout, not interleaved).

The inverse frequencies are computed once in numpy, outside any jit, and enter the program as a literal
constant. Built from `arange` inside jit, XLA rewrites `1 / θ**y` as `θ**-y`, which moves about a third of
them by one float32 bit; the angle error then grows with the position (2e-3 in cos/sin at 32k).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def _inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """float32 `1 / θ**(2i / head_dim)`, the same float32 steps as transformers' default RoPE init:
    the exponent `arange / dim` in float32, the power correctly rounded to float32 (float64 `pow` then
    one rounding, as libm `powf` gives), then a float32 reciprocal."""
    exponent_f = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    base = np.float64(np.float32(theta))  # torch raises a float32 base
    power_f = (base ** exponent_f.astype(np.float64)).astype(np.float32)
    inv_freq_f = np.float32(1.0) / power_f
    inv_freq_f.setflags(write=False)
    return inv_freq_f


@functools.cache
def _llama3_inv_freq(head_dim: int, theta: float, llama3: tuple[float, float, float, int]) -> np.ndarray:
    """Llama 3.1's scaling of the default frequencies, in the float32 steps of transformers'
    `_compute_llama3_parameters`: wavelengths above original_max / low_freq_factor are divided by `factor`,
    those below original_max / high_freq_factor kept, the ones between blended by `smooth`."""
    factor, low, high, original = llama3
    f32 = np.float32  # python scalars meet float32 tensors in torch as float32 (computed in double first)
    base = _inv_freq(head_dim, theta)
    wavelen = np.float32(2 * np.pi) / base
    low_wavelen, high_wavelen = f32(original / low), f32(original / high)
    scaled = np.where(wavelen > low_wavelen, base / f32(factor), base).astype(np.float32)
    smooth = ((f32(original) / wavelen - f32(low)) / f32(high - low)).astype(np.float32)
    smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    out = np.where(medium, smoothed, scaled).astype(np.float32)
    out.setflags(write=False)
    return out


@functools.cache
def yarn_inv_freq(head_dim: int, theta: float, yarn: tuple) -> tuple[np.ndarray, float]:
    """YaRN (DeepSeek-V3, Kimi-K2, long-context Qwen3): frequencies interpolated by `factor` below a ramp between
    the dims of `beta_fast` and `beta_slow` rotations over the original context, kept above it; and the factor
    cos/sin are multiplied by. `yarn` = (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor, truncate), in the float32 steps of transformers' `_compute_yarn_parameters`."""
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate = yarn
    f32 = np.float32
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    exponent_f = np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)
    pos_freqs = (np.float64(f32(theta)) ** exponent_f.astype(np.float64)).astype(np.float32)
    extrapolation = (f32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (f32(1.0) / (f32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - f32(low)) / f32(high - low), 0, 1).astype(np.float32)
    keep = (f32(1) - ramp).astype(np.float32)
    out = (interpolation * (f32(1) - keep) + extrapolation * keep).astype(np.float32)
    out.setflags(write=False)
    return out, float(attention_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None) -> np.ndarray:
    """Read-only float32 [head_dim // 2] inverse frequencies; `llama3` = (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) applies Llama 3.1's scaling."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be a positive even number for RoPE")
    if not theta > 0:
        raise ValueError(f"rope_theta={theta} must be > 0")
    if llama3 is not None:
        return _llama3_inv_freq(int(head_dim), float(theta), tuple(llama3))
    return _inv_freq(int(head_dim), float(theta))


def rope_cos_sin(positions_bt: jax.Array, head_dim: int, theta: float,
                 llama3: tuple[float, float, float, int] | None = None,
                 yarn: tuple | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 cos and sin, each [b, t, head_dim]; angle = float32(position) * inv_freq, one rounding; with
    `yarn` (see `yarn_inv_freq`) its frequencies, cos and sin times its attention factor."""
    if yarn is not None:
        freqs, attention_factor = yarn_inv_freq(int(head_dim), float(theta), tuple(yarn))
    else:
        freqs, attention_factor = inv_freq(head_dim, theta, llama3), 1.0
    inv_freq_f = jnp.asarray(freqs)  # a constant of the traced program
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f
    angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
    if attention_factor == 1.0:
        return jnp.cos(angles_btd), jnp.sin(angles_btd)
    return jnp.cos(angles_btd) * attention_factor, jnp.sin(angles_btd) * attention_factor


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    x = x_bthd.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
    return out.astype(x_bthd.dtype)
