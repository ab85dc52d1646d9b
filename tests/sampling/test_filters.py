"""Temperature / top-k / top-p selection on a small vocabulary, checked statistically with fixed seeds."""

import jax.numpy as jnp
import numpy as np

from tx.sampling.filters import filter_logits, row_keys, select_tokens

PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS)


def _draw(n, temperature, top_k, top_p):
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.int32(0))
    full = lambda x: jnp.full(n, x)  # noqa: E731
    return np.asarray(select_tokens(logits, keys, full(temperature), full(top_k).astype(jnp.int32), full(top_p)))


def test_nucleus_and_top_k_support_and_frequencies():
    n = 20000
    # top_p = 0.6: 0.4 + 0.25 = 0.65 >= 0.6 -> nucleus {0, 1}, renormalised 0.615 / 0.385
    draws = _draw(n, 1.0, -1, 0.6)
    assert set(np.unique(draws)) == {0, 1}
    assert abs(np.mean(draws == 0) - 0.4 / 0.65) < 0.015
    # top_k = 3 -> {0, 1, 2} renormalised
    draws = _draw(n, 1.0, 3, 1.0)
    assert set(np.unique(draws)) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(draws, minlength=6)[:3] / n, PROBS[:3] / PROBS[:3].sum(), atol=0.015)
    # no filtering: the model distribution
    draws = _draw(n, 1.0, 0, 1.0)
    np.testing.assert_allclose(np.bincount(draws, minlength=6) / n, PROBS, atol=0.015)
    # temperature 0.5 sharpens to p^2 / sum p^2
    draws = _draw(n, 0.5, -1, 1.0)
    sharp = PROBS**2 / np.sum(PROBS**2)
    np.testing.assert_allclose(np.bincount(draws, minlength=6) / n, sharp, atol=0.015)


def test_greedy_top_k_one_and_tiny_top_p():
    assert set(_draw(50, 0.0, -1, 1.0)) == {0}
    assert set(_draw(500, 2.0, 1, 1.0)) == {0}
    assert set(_draw(500, 1.0, -1, 1e-6)) == {0}  # the most likely token is always kept


def test_filter_mixes_rows():
    logits = jnp.asarray(np.tile(LOGITS, (2, 1)), jnp.float32)
    out = np.asarray(filter_logits(logits, jnp.array([1.0, 1.0]), jnp.array([2, -1]), jnp.array([1.0, 0.7])))
    # row 0: top-2; row 1: nucleus 0.7 needs 0.4 + 0.25 + 0.15 (mass before token 2 is 0.65 < 0.7)
    assert np.isfinite(out[0]).sum() == 2 and np.isfinite(out[1]).sum() == 3
