"""The device objective and the critic's reduction where the trainer uses them: a non-finite input at a masked
position (a reference log-prob) changes neither the loss nor the gradient (SkyRL masks before it
multiplies), and the critic's mini-batch weights are SkyRL's per-sequence mean, then batch mean."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tx import losses
from tx.rl import critic, objective
from tx.rl.rollout import Trajectory


@pytest.mark.parametrize("kl", objective.KL_ORDER)
def test_non_finite_reference_at_masked_positions_changes_nothing(kl):
    """Through `losses.per_token_losses`, the function every training pass calls (the backend itself refuses
    non-finite inputs in a request; this guards what reaches the loss another way, e.g. an own training loop)."""
    rng = np.random.default_rng(0)
    mask = np.array([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], np.float32)  # response, then padding
    n = mask.sum(axis=1, keepdims=True)
    lp = jnp.asarray(rng.uniform(-6, -1, mask.shape), jnp.float32)
    ref = rng.uniform(-6, -1, mask.shape).astype(np.float32)
    inputs = {"weights": mask / mask.sum(), "logprobs": rng.uniform(-6, -1, mask.shape).astype(np.float32),
              "advantages": rng.normal(size=mask.shape).astype(np.float32) * mask, "rl_mask": mask,
              "kl_weights": mask / n / 2, "entropy_weights": np.zeros_like(mask), "rl_selected": np.zeros_like(mask)}
    name = objective.objective_name("regular")
    config = losses.resolve_config(name, objective.objective_config("regular", kl, {}, 0.5, 0.0))
    keys = tuple(config)
    config_bk = jnp.asarray([[config[k] for k in keys]] * 2, jnp.float32)

    def total(lp, ref_row):
        per = losses.per_token_losses(lp, {k: jnp.asarray(v) for k, v in inputs.items()} | {"ref_logprobs": ref_row},
                                      jnp.zeros(2, jnp.int32), config_bk, (name,), keys)
        return per.sum()

    want, want_grad = jax.value_and_grad(total)(lp, jnp.asarray(ref))
    for bad in (np.nan, np.inf, -np.inf):
        got, got_grad = jax.value_and_grad(total)(lp, jnp.asarray(np.where(mask > 0, ref, bad)))
        assert np.isfinite(float(got)) and np.isfinite(np.asarray(got_grad)).all(), bad
        assert float(got) == float(want)
        np.testing.assert_array_equal(np.asarray(got_grad), np.asarray(want_grad))


def test_critic_weights_are_a_sequence_mean_then_a_batch_mean():
    """SkyRL: masked_mean(loss, mask, dim=-1).mean(). V=[[1,1],[2,0]], old=V, R=0, M=[[1,1],[1,0]]: 1.25 (a token
    mean would give 1.0)."""
    values, mask = np.array([[1.0, 1.0], [2.0, 0.0]]), np.array([[1.0, 1.0], [1.0, 0.0]])
    episodes = [Trajectory(group=i, prompt_ids=[5, 6], response_ids=[7, 8], loss_mask=[1, int(i == 0)])
                for i in range(2)]
    prep = {"mask": mask, "values": values, "returns": np.zeros_like(values)}
    datums, loss, config = critic.value_datums(episodes, np.arange(2), prep, value_clip=0.0)
    assert loss == objective.VALUE_OBJECTIVE
    total = 0.0
    for d, v in zip(datums, values):
        w = np.asarray(d["weights"])[1:]  # response targets follow the prompt's last one
        total += float((w * 0.5 * v**2).sum())
    assert total == pytest.approx(1.25, abs=1e-7)
