"""tx.rl jobs over time and side by side: resuming from a checkpoint equals going on without a restart, and
a job of two runs (different seeds, learning rates, ranks, losses) equals each run alone."""

import numpy as np
import pytest
from pydantic import ValidationError

from tests.rl.test_trainer import example
from tx.models.adapters import get_adapter_weights
from tx.rl.trainer import RLTrainer


def test_resume_equals_the_uninterrupted_run(tmp_path):
    """A trainer that stops after 2 steps and a new one resuming from its step-2 checkpoint give the same
    steps 3 and 4 as the first trainer going on without a restart."""
    common = {"epochs": 1, "train_batch_size": 16, "policy_mini_batch_size": 8, "ckpt_interval": 2,
              "eval_before_train": False, "eval_interval": -1}
    first = RLTrainer(example(tmp_path, **common))
    assert first.fit(stop_after=2) == {"interrupted_at": 2}
    resumed = RLTrainer(example(tmp_path, resume_mode="from_path", resume_path=str(tmp_path / "ckpts/global_step_2"),
                                **common))
    resumed.resume()
    assert resumed.global_step == 2
    for _ in range(2):
        want, got = first.train_step(), resumed.train_step()
        assert got["step"] == want["step"]
        for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/grad_norm", "policy/policy_kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


RUNS = [{"name": "a", "trainer": {"policy": {"optimizer_config": {"lr": 0.02}}}},
        {"name": "b", "trainer": {"seed": 1, "policy": {"optimizer_config": {"lr": 0.01}, "model": {"lora": {"rank": 4}}},
                                  "algorithm": {"policy_loss_type": "gspo", "loss_reduction": "sequence_mean",
                                                "kl_estimator_type": "k1"}}}]


def test_two_runs_in_one_job_equal_each_run_alone(tmp_path):
    common = {"epochs": 1, "eval_before_train": False, "eval_interval": -1, "ckpt_interval": -1, "hf_save_interval": -1}
    job = RLTrainer(example(tmp_path / "job", runs=RUNS, **common))
    alone = {run["name"]: RLTrainer(example(tmp_path / run["name"], runs=[run], **common)) for run in RUNS}
    for _ in range(3):
        together = job.train_step()
        for name, trainer in alone.items():
            single = trainer.train_step()
            for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/grad_norm", "policy/policy_kl"):
                assert together[f"{name}/{key}"] == pytest.approx(single[f"{name}/{key}"], rel=1e-5, abs=1e-7), key
    assert together["a/reward/avg_raw_reward"] != together["b/reward/avg_raw_reward"]
    for name, trainer in alone.items():
        mine, theirs = (t.backend.models[name] for t in (job, trainer))
        a = get_adapter_weights(job.backend.model, mine.adapter_index, mine.lora_config.rank)
        b = get_adapter_weights(trainer.backend.model, theirs.adapter_index, theirs.lora_config.rank)
        for key in a:
            for mine_w, theirs_w in zip(a[key], b[key]):
                np.testing.assert_allclose(mine_w, theirs_w, rtol=0, atol=1e-5)
    with pytest.raises(ValidationError, match=r"runs\['a'\].trainer.train_batch_size: a run may only set"):
        example(tmp_path, runs=[{"name": "a", "trainer": {"train_batch_size": 4}}])
