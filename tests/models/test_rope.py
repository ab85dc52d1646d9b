"""RoPE inverse frequencies and cos/sin equal transformers' Qwen3 rotary embedding."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from tx.models.layers.rope import inv_freq, rope_cos_sin

THETAS = [1e6, 1e4, 5e5]
DIMS = [128, 64, 96]

# transformers' own init, run by torch's scalar (libm) kernels: ATEN_CPU_CAPABILITY=default
_HF_INV_FREQ = """
import json, sys
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
out = {}
for theta, dim in json.loads(sys.argv[1]):
    cfg = Qwen3Config(head_dim=dim, hidden_size=1024, num_attention_heads=16, rope_theta=theta)
    out[f"{theta}/{dim}"] = Qwen3RotaryEmbedding.compute_default_rope_parameters(cfg)[0].numpy().view("uint32").tolist()
print(json.dumps(out))
"""


def _hf_rotary(theta: float, dim: int) -> Qwen3RotaryEmbedding:
    cfg = Qwen3Config(head_dim=dim, hidden_size=1024, num_attention_heads=16, rope_theta=theta)
    assert cfg.rope_parameters["rope_type"] == "default"
    return Qwen3RotaryEmbedding(cfg)


def test_inv_freq_bit_identical_to_transformers_scalar_kernels():
    cases = [(theta, dim) for theta in THETAS for dim in DIMS]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", _HF_INV_FREQ, json.dumps(cases)], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    want = json.loads(out.stdout.strip().splitlines()[-1])
    for theta, dim in cases:
        got = inv_freq(dim, theta)
        assert got.dtype == np.float32 and got.shape == (dim // 2,)
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want[f"{theta}/{dim}"], np.uint32),
                                      err_msg=f"theta={theta} head_dim={dim}")


@pytest.mark.parametrize("theta", THETAS)
def test_inv_freq_vs_transformers_simd_kernels(theta):
    """In-process transformers (torch's SIMD `pow`, 1 ulp accurate, not correctly rounded) agrees bit for
    bit except where its power is not the correctly rounded one; there tx holds the correctly rounded value."""
    dim = 128
    want = _hf_rotary(theta, dim).inv_freq.numpy()
    got = inv_freq(dim, theta)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32))
    assert ulps.max() <= 1
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    mpmath.mp.prec = 120
    for i in np.nonzero(ulps)[0]:
        exact_power = np.float32(float(mpmath.power(mpmath.mpf(theta), mpmath.mpf(float(exps[i])))))
        assert got[i] == np.float32(1.0) / exact_power, f"theta={theta} index {i}"
    assert (ulps > 0).sum() <= 2, f"theta={theta}: {np.nonzero(ulps)[0]} differ"


@pytest.mark.parametrize("theta", THETAS)
def test_cos_sin_match_transformers_up_to_32k(theta):
    rot = _hf_rotary(theta, 128)
    pos = np.arange(32768, dtype=np.int64)[None]
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), torch.tensor(pos))
    got_cos, got_sin = jax.jit(rope_cos_sin, static_argnums=(1, 2))(jnp.asarray(pos, jnp.int32), 128, theta)
    # (inside jit, the old arange-built frequencies were 2e-3 off here; one ulp of inv_freq is < 7e-7 rad)
    np.testing.assert_allclose(np.asarray(got_cos), cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_sin), sin.numpy(), rtol=0, atol=1e-6)


def test_bad_rope_arguments_name_the_value():
    with pytest.raises(ValueError, match="head_dim=7"):
        inv_freq(7, 1e6)
    with pytest.raises(ValueError, match="rope_theta=0"):
        inv_freq(128, 0.0)
