"""Blockwise (flash) and splash (Pallas interpret mode) attention against the dense reference kernel.

The reference (`tx.kernels.attention.attention`, itself checked against numpy in test_attention.py) is
given the same visibility rule as a dense mask. float32 outputs and gradients must agree to 1e-5 of the
tensor's largest value; bf16 inputs must be within 1.5x the reference's own bf16-vs-f32 error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels.attention import reference_self_attention
from tx.kernels.flash import blockwise_attention
from tx.kernels.splash import splash_attention


def _inputs(seed, b, t, h, kv, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal((b, t, n, d)), dtype) for n in (h, kv, kv, h))
    seg = np.zeros((b, t), np.int32)
    seg[0, t // 3 :] = 1  # row 0: two packed segments, then padding
    seg[0, (2 * t) // 3 :] = 2
    seg[0, t - t // 5 :] = -1
    if b > 1:
        seg[1, t - t // 4 :] = -1  # row 1: one sequence, then padding
    return q, k, v, w.astype(jnp.float32), jnp.asarray(seg)


def _value_and_grads(fn, q, k, v, w, seg, d):
    """Output and d(sum(out * w))/d(q, k, v), jitted; `w` weights every position, padding included."""

    def loss(q, k, v):
        out = fn(q, k, v, seg, d**-0.5)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _assert_close(got, want, rel=1e-5):
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=rel * max(1.0, np.abs(r).max()), err_msg=name)


# (t, q heads, kv heads, block_q, block_kv): GQA ratios 1/2/4/8, blocks that do not divide t
CASES = [(1, 2, 2, 16, 8), (7, 4, 2, 4, 3), (128, 8, 2, 48, 32), (1000, 8, 1, 96, 64)]


@pytest.mark.parametrize("t,h,kv,bq,bk", CASES)
def test_blockwise_matches_reference_f32(t, h, kv, bq, bk):
    d = 16
    q, k, v, w, seg = _inputs(t, 2, t, h, kv, d)
    got = _value_and_grads(
        lambda *a: blockwise_attention(*a, block_q=bq, block_kv=bk), q, k, v, w, seg, d
    )
    _assert_close(got, _value_and_grads(reference_self_attention, q, k, v, w, seg, d))


def test_blockwise_bf16_error_within_reference_bf16_error():
    d, t = 32, 200
    q, k, v, w, seg = _inputs(3, 2, t, 8, 4, d)
    exact = _value_and_grads(reference_self_attention, q, k, v, w, seg, d)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    ref_bf16 = _value_and_grads(reference_self_attention, *low, w, seg, d)
    got = _value_and_grads(lambda *a: blockwise_attention(*a, block_q=64, block_kv=48), *low, w, seg, d)
    for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref_bf16, exact, strict=True):
        ref_err, our_err = np.abs(r - e).max(), np.abs(g - e).max()
        assert our_err <= 1.5 * ref_err, f"{name}: blockwise bf16 error {our_err} vs reference bf16 {ref_err}"


def test_padding_only_rows_and_huge_scores_stay_finite():
    d = 8
    q, k, v, w, _ = _inputs(4, 2, 20, 2, 1, d)
    seg = jnp.full((2, 20), -1, jnp.int32).at[1, :3].set(0)  # row 0 is all padding
    got = _value_and_grads(lambda *a: blockwise_attention(*a, block_q=8, block_kv=8), q * 1e4, k, v, w, seg, d)
    assert all(np.isfinite(x).all() for x in got)
    want = _value_and_grads(reference_self_attention, q * 1e4, k, v, w, seg, d)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)  # a softmax this peaked is a one-hot pick


def test_splash_interpret_matches_reference_f32():
    d, t = 16, 130  # one 128-lane block does not divide t: internal padding
    q, k, v, w, seg = _inputs(5, 2, t, 4, 1, d)
    got = _value_and_grads(lambda *a: splash_attention(*a, block=128, interpret=True), q, k, v, w, seg, d)
    _assert_close(got, _value_and_grads(reference_self_attention, q, k, v, w, seg, d))


def _temp_bytes(fn, t, h=4, kv=2, d=64):
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    y = jax.ShapeDtypeStruct((1, t, kv, d), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s, d**-0.5) ** 2), argnums=(0, 1, 2))
    return jax.jit(grad).lower(x, y, y, seg).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_forward_backward_memory_is_linear_in_t():
    """XLA's temp buffers of forward+backward: a t² kernel needs 4x from 4k to 8k tokens, and the dense
    reference's score tensor alone is h·t²·4 bytes (1 GiB at 8k); blockwise stays ~2x and far below."""
    small, large = _temp_bytes(blockwise_attention, 4096), _temp_bytes(blockwise_attention, 8192)
    dense = _temp_bytes(reference_self_attention, 8192)
    assert large <= 2.5 * small, (small, large)
    assert large * 20 < dense, (large, dense)
