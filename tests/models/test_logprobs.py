"""tx.models.logprobs: the frozen-head log-prob pass against PyTorch autograd (float64), and against the
rematerialising pass where the model is bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.require import require_module
from tx.models.logprobs import chunked_target_logprobs, frozen_head_target_logprobs

torch = require_module("torch")

B, T, D, V = 3, 11, 16, 53


def _inputs(k_targets: int):
    rng = np.random.default_rng(k_targets)
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)
    shape = (B, T) if k_targets == 0 else (B, T, k_targets)
    return h, w, jnp.asarray(rng.integers(0, V, shape)), jnp.asarray(rng.normal(size=shape), jnp.float32)


def _torch_reference(h, w, targets, cotangent, temperature):
    """log p(targets) of `h W / T` and the gradients of `sum(cotangent * log p)` for h and W, float64 autograd."""
    h_t = torch.tensor(np.asarray(h), dtype=torch.float64, requires_grad=True)
    w_t = torch.tensor(np.asarray(w), dtype=torch.float64, requires_grad=True)
    logits = h_t @ w_t
    if temperature is not None:
        logits = logits / torch.tensor(np.asarray(temperature), dtype=torch.float64)[:, None, None]
    targets_t = torch.tensor(np.asarray(targets))
    several = targets_t.ndim == 3
    out = torch.gather(torch.log_softmax(logits, -1), -1, targets_t if several else targets_t[..., None])
    out = out if several else out[..., 0]
    (out * torch.tensor(np.asarray(cotangent), dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), h_t.grad.numpy(), w_t.grad.numpy()


@pytest.mark.parametrize("k_targets", [0, 3])
@pytest.mark.parametrize("tempered", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 1024])  # 4: one position of every row per chunk, time padded
def test_frozen_head_logprobs_and_gradients_match_torch(k_targets, tempered, chunk_size):
    """Values and the hidden states' gradient (the frozen-head backward), and with W differentiated too (full
    fine-tuning: the rematerialising pass), equal float64 autograd to 2e-6."""
    h, w, targets, cotangent = _inputs(k_targets)
    temperature = jnp.asarray([1.0, 0.7, 1.3]) if tempered else None

    def loss(h_, w_):
        return jnp.sum(frozen_head_target_logprobs(h_, w_, targets, temperature, chunk_size) * cotangent)

    want, want_dh, want_dw = _torch_reference(h, w, targets, cotangent, temperature)
    np.testing.assert_allclose(frozen_head_target_logprobs(h, w, targets, temperature, chunk_size), want, atol=2e-6)
    np.testing.assert_allclose(jax.grad(loss)(h, w), want_dh, atol=2e-6)
    dh, dw = jax.grad(loss, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(dh, want_dh, atol=2e-6)
    np.testing.assert_allclose(dw, want_dw, atol=2e-6)


def test_frozen_head_masked_targets_out_of_range_give_finite_gradients():
    """A position whose cotangent is 0 (masked) may hold any target id: its gradient stays 0, never NaN."""
    h, w, targets, cotangent = _inputs(0)
    targets = targets.at[:, -2:].set(-1)
    cotangent = cotangent.at[:, -2:].set(0.0)
    dh = jax.grad(lambda h_: jnp.sum(frozen_head_target_logprobs(h_, w, targets, None, 8) * cotangent))(h)
    assert np.all(np.isfinite(dh)) and not np.any(dh[:, -2:])
    want = _torch_reference(h, w, jnp.where(targets < 0, 0, targets), cotangent, None)[1]
    np.testing.assert_allclose(dh[:, :-2], want[:, :-2], atol=2e-6)


def test_frozen_head_bfloat16_equals_the_rematerialising_pass():
    """A bfloat16 model: log-probs and bfloat16 gradients as autodiff of the rematerialising pass gives them
    (the same float32 x bfloat16 contraction), to one bfloat16 rounding."""
    h, w, targets, cotangent = _inputs(0)
    h, w = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def remat(h_):
        logits_fn = lambda x, _: jnp.dot(x, w, preferred_element_type=jnp.float32)  # noqa: E731
        return chunked_target_logprobs(logits_fn, h_, targets, None, 8)

    def frozen(h_):
        return frozen_head_target_logprobs(h_, w, targets, None, 8)

    np.testing.assert_allclose(frozen(h), remat(h), atol=1e-6)
    got = jax.grad(lambda h_: jnp.sum(frozen(h_) * cotangent))(h)
    want = jax.grad(lambda h_: jnp.sum(remat(h_) * cotangent))(h)
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=scale * 2 ** -8)
