"""tx.rl jobs side by side and over several data batches: a job of two runs (different seeds, learning rates,
ranks, losses; one of them PPO with GAE and a critic) equals each run alone, checkpoints its critic, and
samples further batches for the one run that uses dynamic sampling; and dynamic sampling draws more batches until the kept groups'
rewards differ. (Exact resume: test_trainer.py's example test.)"""

import json

import numpy as np
import pytest
from pydantic import ValidationError

import tx.rl
from tests.rl.test_trainer import example
from tx.models.adapters import get_adapter_weights
from tx.rl.trainer import RLTrainer


RUNS = [{"name": "a", "trainer": {"policy": {"optimizer_config": {"lr": 0.02}}}},
        {"name": "b", "trainer": {"seed": 1, "policy": {"optimizer_config": {"lr": 0.01}, "model": {"lora": {"rank": 4}}},
                                  "algorithm": {"policy_loss_type": "gspo", "loss_reduction": "sequence_mean",
                                                "kl_estimator_type": "k1", "advantage_estimator": "gae",
                                                "lambd": 0.95},
                                  "critic": {"model": {"lora": {"rank": 4}}, "optimizer_config": {"lr": 0.01}}}}]
CRITIC_KEYS = ("critic/critic_loss", "critic/grad_norm", "critic/values_mean", "critic/returns_mean")


def test_two_runs_in_one_job_equal_each_run_alone(tmp_path):
    common = {"epochs": 1, "eval_before_train": False, "eval_interval": -1, "ckpt_interval": -1, "hf_save_interval": -1,
              "train_batch_size": 4, "policy_mini_batch_size": 4, "critic_mini_batch_size": 2}
    job = RLTrainer(example(tmp_path / "job", runs=RUNS, **common))
    alone = {run["name"]: RLTrainer(example(tmp_path / run["name"], runs=[run], **common)) for run in RUNS}
    for _ in range(1):  # one step: its metrics, then the updated weights, are compared
        together = job.train_step()
        for name, trainer in alone.items():
            single = trainer.train_step()
            for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/grad_norm", "policy/policy_kl",
                        *(CRITIC_KEYS if name == "b" else ())):
                assert together[f"{name}/{key}"] == pytest.approx(single[f"{name}/{key}"], rel=1e-5, abs=1e-7), key
    assert together["a/reward/avg_raw_reward"] != together["b/reward/avg_raw_reward"]
    assert "a/critic/critic_loss" not in together and together["b/critic/critic_loss"] > 0.0
    for name, trainer in alone.items():
        mine, theirs = (t.policy.backend.models[name] for t in (job, trainer))
        a = get_adapter_weights(job.policy.backend.model, mine.adapter_index, mine.lora_config.rank)
        b = get_adapter_weights(trainer.policy.backend.model, theirs.adapter_index, theirs.lora_config.rank)
        for key in a:
            for mine_w, theirs_w in zip(a[key], b[key]):
                np.testing.assert_allclose(mine_w, theirs_w, rtol=0, atol=1e-5)
    # the critic (LoRA and value head) goes into the job's checkpoint and loads back (here into b's own trainer)
    step_dir = job.save()
    again = alone["b"]
    again.policy.load("b-critic", step_dir / "b-critic", {})
    slot = {t: t.policy.backend.models["b-critic"].adapter_index for t in (job, again)}
    heads = [np.asarray(t.policy.backend.model.lm_head.value_head[...][slot[t]]) for t in (job, again)]
    assert np.any(heads[0]) and np.array_equal(*heads)
    saved, loaded = (get_adapter_weights(t.policy.backend.model, slot[t], 4) for t in (job, again))
    for key in saved:
        np.testing.assert_array_equal(saved[key][1], loaded[key][1])
    # dynamic sampling per run of a shared job: b keeps only groups whose rewards differ, drawing batches for
    # itself alone once a (no dynamic sampling) took the first one as it is
    job.train_rows = job._load([_half_constant_data(tmp_path, constant_every=2)])
    job.steps_per_epoch = job.total_steps = len(job.train_rows) // 4
    job.batches_used = 0
    job._run("b").cfg.trainer.algorithm.dynamic_sampling.type = "filter"
    record = {}
    out = job._collect(record)
    assert len(out["a"]) == len(out["b"]) == 4 * 8
    rewards = {name: {} for name in out}
    for name, trajectories in out.items():
        for tr in trajectories:
            rewards[name].setdefault(tr.group, []).append(tr.reward)
    assert all(len(set(r)) > 1 for r in rewards["b"].values()) and any(set(r) == {0.5} for r in rewards["a"].values())
    assert job.batches_used == record["b/dynamic_sampling/sampled_batches"] >= 2
    assert "a/dynamic_sampling/sampled_batches" not in record
    with pytest.raises(ValidationError, match=r"runs\['a'\].trainer.train_batch_size: a run may only set"):
        example(tmp_path, runs=[{"name": "a", "trainer": {"train_batch_size": 4}}])


@tx.rl.register_env("test_half_constant", replace=True)
class HalfConstant(tx.rl.Env):
    """Rows with extras['constant'] always score 0.5 (a group with no reward variance); others score the
    parity of the reply's length (varies within a group)."""

    def init(self, prompt, extras):
        self.constant = bool(extras.get("constant"))
        return prompt

    def step(self, action):
        return tx.rl.StepOutput(reward=0.5 if self.constant else float(len(action) % 2), done=True)


def _half_constant_data(tmp_path, constant_every: int) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"Say something, {i}."}], "env_class": "test_half_constant",
             "constant": i % constant_every == 0} for i in range(32)]
    path = tmp_path / "half.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ(tmp_path):
    cfg = example(tmp_path, train_batch_size=4, policy_mini_batch_size=4, eval_before_train=False, eval_interval=-1,
                  algorithm={"dynamic_sampling": {"type": "filter", "min_replace_ratio": 0.3, "max_sample_batches": 3}})
    cfg.data.train_data = [_half_constant_data(tmp_path, constant_every=2)]
    trainer = RLTrainer(cfg)
    ds = trainer.runs[0].cfg.trainer.algorithm.dynamic_sampling
    for kind in ("filter", "replace"):
        ds.type = kind
        ds.min_replace_ratio = 0.0  # replace: any batch with a good group is used, bad groups copy good ones
        used, record = trainer.batches_used, {}
        trajectories = trainer._collect(record)["policy"]
        groups: dict[int, list] = {}
        for tr in trajectories:
            groups.setdefault(tr.group, []).append(tr)
        assert sorted(groups) == [0, 1, 2, 3] and all(len(g) == 8 for g in groups.values())
        for members in groups.values():
            assert len({tr.reward for tr in members}) > 1, [tr.reward for tr in members]
        sampled = record["dynamic_sampling/sampled_batches"]
        assert trainer.batches_used - used == sampled and (sampled >= 2 if kind == "filter" else sampled == 1)
        if kind == "replace" and any(tr.reward == 0.5 for tr in trajectories):
            raise AssertionError("a constant group was kept")
    step = trainer.train_step()  # a step trains on what was kept
    assert step["step"] == 1 and np.isfinite(step["policy/grad_norm"])
    for row in trainer.train_rows:  # every group constant: give up after max_sample_batches
        row.extras["constant"] = True
    ds.type = "filter"
    with pytest.raises(RuntimeError, match=r"3 batches sampled \(max_sample_batches=3\)"):
        trainer._collect({})
