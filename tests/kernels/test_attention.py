import jax.numpy as jnp
import numpy as np

from tx.kernels.attention import attention, causal_mask


def _reference(q, k, v, mask, scale):
    """Plain numpy: repeat kv heads, masked softmax per query head."""
    b, t, h, d = q.shape
    rep = h // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi].T * scale
            s = np.where(mask[bi], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p = np.nan_to_num(p / p.sum(-1, keepdims=True))
            out[bi, :, hi] = p @ v[bi, :, hi]
    return out


def test_gqa_padding_and_segments_match_numpy():
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 6, 4, 2, 8
    q, k, v = (rng.standard_normal((b, t, n, d)).astype(np.float32) for n in (h, kv, kv))
    attn_mask = np.array([[1] * 6, [1] * 4 + [0] * 2])
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    mask = np.asarray(causal_mask(jnp.asarray(attn_mask), jnp.asarray(segments)))
    assert mask[0, 3, 2] == 0 and mask[0, 4, 3] == 1 and mask[1, 3, 4] == 0 and mask[1, 2, 3] == 0
    got = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), d**-0.5)
    want = _reference(q, k, v, mask, d**-0.5)
    valid = attn_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(got)))  # padding rows are finite, not NaN
