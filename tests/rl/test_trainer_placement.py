"""SkyRL 0.4.0's algorithms where the trainer wires them: `rollout_is` reads the sampler's log-probs the trajectories
recorded, `prompt_mean` groups the mini-batch by prompt, and `loss_reduction_placement` puts the reduction in the
weights ("loss", the seed's) or in the advantages ("advantages", SkyRL 0.4.0) with the same loss for a loss
linear in A. The reference is a numpy loop over the datums' tokens, on the log-probs forward returned."""

import math

import numpy as np
import pytest

from tests.rl.test_trainer import example
from tx.rl import objective, update
from tx.rl.prepare import prepare
from tx.rl.trainer import RLTrainer


def test_rollout_is_with_prompt_mean_in_the_loss_or_in_the_advantages(tmp_path):
    trainer = RLTrainer(example(
        tmp_path, {"sampling_params": {"max_generate_length": 12}, "n_samples_per_prompt": 4},
        algorithm={"policy_loss_type": "rollout_is", "loss_reduction": "prompt_mean", "use_kl_loss": False,
                   "eps_clip_low": 0.2, "eps_clip_high": 0.2},
        eval_before_train=False, eval_interval=-1, train_batch_size=4, policy_mini_batch_size=4, ckpt_interval=-1,
        hf_save_interval=-1))
    run = trainer.runs[0]
    episodes = trainer._collect({})["policy"]
    prep, _ = prepare(run, episodes, None, None)
    idx = np.arange(len(episodes))
    rng = np.random.default_rng(0)
    losses, datums_by = {}, {}
    for placement in ("loss", "advantages"):
        run.cfg.trainer.algorithm.loss_reduction_placement = placement
        datums, loss, config = update.minibatch(run, episodes, prep, idx, rng)
        out = trainer.policy.forward({"policy": (datums, loss, config)})["policy"]
        losses[placement], datums_by[placement] = out, datums
    # numpy: prompt_mean = mean over prompts of each prompt's token mean; rollout_is: -sg(f) * A * lp with
    # f = exp(lp - rollout) strictly inside (0.8, 1.2), else 0
    tokens = {}
    for tr in episodes:
        tokens[tr.group] = tokens.get(tr.group, 0) + sum(tr.loss_mask)
    want = 0.0
    for tr, d, o in zip(episodes, datums_by["loss"], losses["loss"].outputs):
        s = len(tr.prompt_ids) - 1
        adv = d["advantages"][s:]
        for t, (lp, roll, m) in enumerate(zip(o["logprobs"][s:], tr.logprobs, tr.loss_mask)):
            ratio = math.exp(lp - roll)
            f = ratio if 0.8 < ratio < 1.2 else 0.0
            want += m / (len(tokens) * max(tokens[tr.group], 1)) * (-f * adv[t] * lp)
        np.testing.assert_allclose(d["extra"]["rl_rollout_logprobs"][s:], tr.logprobs, rtol=0, atol=0)
    assert abs(want) > 1e-3
    assert losses["loss"].loss_sum == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert losses["advantages"].loss_sum == pytest.approx(want, rel=1e-4, abs=1e-7)
    # "advantages": the datums carry A * s and weights = the mask (no reduction in them)
    for tr, d_loss, d_adv in zip(episodes, datums_by["loss"], datums_by["advantages"]):
        s = len(tr.prompt_ids) - 1
        scale = 1.0 / (len(tokens) * max(tokens[tr.group], 1))
        np.testing.assert_allclose(d_adv["advantages"][s:], np.asarray(d_loss["advantages"][s:]) * scale, rtol=1e-6)
        np.testing.assert_array_equal(d_adv["weights"][s:], tr.loss_mask)
    assert loss == objective.objective_name("rollout_is")
