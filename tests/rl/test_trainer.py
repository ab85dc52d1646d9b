"""tx.rl trainer: the bundled example learns its reward, KL to the base model is 0 before the first update,
the device loss equals numpy on the seed's formulas, multi-turn episodes keep sampled tokens (and their
forward log-probs) apart from observation tokens, and config errors name the field. (Resume and multi-run
jobs: test_trainer_runs.py.)"""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

import tx.rl
from tests.helpers import make_batch
from tx.rl.__main__ import load_config, main
from tx.rl.config import RLConfig
from tx.rl import objective
from tx.rl.trainer import RLTrainer

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples/rl_tiny.yaml"


def example(tmp_path, generator=None, runs=None, algorithm=None, **trainer) -> RLConfig:
    values = yaml.safe_load(EXAMPLE.read_text())
    values["runs"] = runs or []
    values["trainer"]["algorithm"] |= algorithm or {}
    values["data"] = {k: [str(ROOT / p) for p in v] for k, v in values["data"].items()}
    values["trainer"] |= {"ckpt_path": str(tmp_path / "ckpts"), "export_path": str(tmp_path / "exports"), **trainer}
    values["generator"] |= generator or {}
    values["tx"] = {"metrics_file": str(tmp_path / "metrics.jsonl")}
    return RLConfig.model_validate(values)


def test_example_learns_its_reward_kl_starts_at_zero_and_resume_is_exact(tmp_path, capsys):
    assert main(["--config", str(EXAMPLE), f"trainer.ckpt_path={tmp_path}/ck", f"trainer.export_path={tmp_path}/ex",
                 f"tx.metrics_file={tmp_path}/m.jsonl", "trainer.epochs=2"]) == 0
    records = [yaml.safe_load(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/avg_raw_reward" in r]
    assert len(steps) == 16
    assert steps[0]["reward/avg_raw_reward"] < 0.3, steps[0]
    assert max(r["reward/avg_raw_reward"] for r in steps[-4:]) >= 0.8, [r["reward/avg_raw_reward"] for r in steps]
    assert steps[0]["policy/policy_kl"] == 0.0  # B = 0 before the first update: the policy is the base model
    assert steps[-1]["policy/policy_kl"] > 0.0
    assert 0 < steps[-1]["policy/policy_entropy"] < steps[0]["policy/policy_entropy"]  # sharper as it learns
    evals = [r for r in records if "eval/all/avg_score" in r]
    assert evals[0]["step"] == 0 and evals[-1]["eval/all/avg_score"] > evals[0]["eval/all/avg_score"]
    assert (tmp_path / "ck/global_step_16/policy").is_dir() and (tmp_path / "ck/latest_ckpt_global_step.txt").read_text() == "16"
    assert (tmp_path / "ex/global_step_16/policy/adapter_model.safetensors").exists()
    # resuming from the step-8 checkpoint gives the uninterrupted run's steps 9 and 10 (same data, same samples)
    resumed = RLTrainer(example(tmp_path / "resumed", epochs=2, eval_before_train=False, eval_interval=-1,
                                resume_mode="from_path", resume_path=str(tmp_path / "ck/global_step_8")))
    resumed.resume()
    assert resumed.global_step == 8
    for want in steps[8:10]:
        got = resumed.train_step()
        assert got["step"] == want["step"]
        for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/grad_norm", "policy/policy_kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


PAIRS = [("regular", "k3"), ("dual_clip", "k1"), ("cispo", "k2"), ("gspo", "abs")]


def test_objective_equals_numpy(tiny_dirs):
    """forward's elementwise loss = weights * policy loss + coef * kl_weights * kl - coef * entropy_weights * H,
    each from the seed's formula in numpy on the log-probs forward returns; one call mixes four (policy loss, KL
    estimator) pairs, each request choosing its own through the objective's config."""
    backend = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=4, max_seq_len=32))
    backend.create_model("p", tx.types.LoraConfig(rank=4))
    rng = np.random.default_rng(0)
    params = {"eps_clip_low": 0.2, "eps_clip_high": 0.28, "clip_ratio_c": 3.0, "cispo_eps_clip_low": 0.0,
              "cispo_eps_clip_high": 5.0}
    requests, extra = [], {k: [] for k in objective.EXTRA_INPUTS}
    for r, (policy, kl) in enumerate(PAIRS):
        datums = []
        for n in (9, 5):
            seq = rng.integers(0, 512, n + 1)
            mask = (rng.uniform(size=n) < 0.8).astype(float)
            datums.append({"input_ids": seq[:-1].tolist(), "targets": seq[1:].tolist(),
                           "weights": (mask * rng.uniform(0.1, 1, n)).tolist(),
                           "logprobs": rng.uniform(-8, -4, n).tolist(), "advantages": rng.normal(size=n).tolist()})
            extra["ref_logprobs"].append(rng.uniform(-8, -4, n).tolist())
            extra["kl_weights"].append((mask * 0.05).tolist())
            extra["entropy_weights"].append((mask * 0.1).tolist())
            extra["rl_mask"].append(mask.tolist())
            extra["rl_selected"].append([0.0] * n)
            extra["rl_rollout_logprobs"].append(datums[-1]["logprobs"])  # on-policy: the sampler's are the old ones
        spec = tx.rl.algorithms.policy_loss(policy)
        config = objective.objective_config(policy, kl, {k: v for k, v in params.items() if k in spec.params}, 0.3, 0.02)
        requests.append((f"r{r}", "p", datums, objective.objective_name(policy), config))
    out = backend.forward(make_batch(requests, all_extra_inputs=extra))
    i = 0
    for (policy, kl), (request_id, _, datums, _, _) in zip(PAIRS, requests):
        for d, o in zip(datums, out[request_id].loss_fn_outputs):
            lp = o["logprobs"].to_numpy().astype(np.float64)
            old, adv, w = (np.asarray(d[k]) for k in ("logprobs", "advantages", "weights"))
            ref, klw, m = (np.asarray(extra[k][i]) for k in ("ref_logprobs", "kl_weights", "rl_mask"))
            ratio = np.exp(lp - old)
            lo, hi = 1 - params["eps_clip_low"], 1 + params["eps_clip_high"]
            if policy == "gspo":
                seq = np.exp((m * (lp - old)).sum() / max(m.sum(), 1))
                ratio = np.full_like(lp, min(seq, np.exp(10)))
            if policy == "cispo":
                pg = -adv * np.clip(ratio, 1 - params["cispo_eps_clip_low"], 1 + params["cispo_eps_clip_high"]) * lp
            else:
                pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, lo, hi))
                if policy == "dual_clip":
                    pg = np.where(adv < 0, np.minimum(-adv * params["clip_ratio_c"], pg), pg)
            d_ = ref - lp
            kl_t = {"k1": lp - ref, "k2": 0.5 * (lp - ref) ** 2, "abs": np.abs(lp - ref),
                    "k3": np.clip(np.exp(np.clip(d_, -20, 20)) - np.clip(d_, -20, 20) - 1, -10, 10)}[kl]
            # each position's entropy: checked against torch in tests/backends/test_jax_backend.py
            want = w * pg + 0.3 * klw * kl_t - 0.02 * np.asarray(extra["entropy_weights"][i]) * o["entropy"].to_numpy()
            np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), want, rtol=2e-5, atol=1e-6, err_msg=policy)
            i += 1


def test_each_policy_loss_is_its_own_registered_loss_and_follows_the_registry():
    """No id numbers: the objective of policy loss p is the tx loss "tx.rl.policy.<p>", registered and removed with
    p; a server without p refuses its datums by name."""
    config = objective.objective_config("regular", "k3", {}, 0.0, 0.0)
    assert "policy_loss" not in config
    assert {objective.objective_name(p) for p in tx.rl.algorithms.policy_loss_names()} <= set(tx.losses.names())
    with pytest.raises(ValueError, match=r"'kl_estimator'\]=7.0 is not an index"):
        tx.losses.resolve_config(objective.objective_name("regular"), {**config, "kl_estimator": 7.0})
    with pytest.raises(ValueError, match="has no parameter 'eps_clip_low'"):
        objective.objective_config("cispo", "k3", {"eps_clip_low": 0.1}, 0.0, 0.0)
    name = "test_objective_follows"
    tx.rl.algorithms.register_policy_loss(name, lambda lp, inputs, params: -params["s"] * lp, params={"s": 2.0})
    try:
        assert tx.losses.get(objective.objective_name(name)).config_defaults["s"] == 2.0
    finally:
        tx.rl.algorithms.unregister_policy_loss(name)
    with pytest.raises(KeyError, match=f"unknown loss function 'tx.rl.policy.{name}'"):
        tx.losses.get(objective.objective_name(name))


def test_rank_0_and_temperature_train_against_a_frozen_tempered_reference(tmp_path, caplog):
    """lora.rank=0: full training (FullBackend; trainer.bf16=False: float32 weights), with the KL loss against a frozen copy of the base weights; and
    generator.sampling_params.temperature=0.7 (algorithm.temperature follows): the old log-probs come from a
    forward at 0.7 (the sampler's are untempered). Before the update the ratio is 1 (nothing clipped) and the
    tempered reference equals the policy (KL exactly 0); after it KL > 0 (the reference did not move with the
    policy). Exports are HF models."""
    policy = {"model": {"path": "tiny", "lora": {"rank": 0}}, "optimizer_config": {"lr": 1e-4, "weight_decay": 0.0}}
    # the example's prompts, and three too long for max_prompt_length: dropped with a warning and a metric
    data = tmp_path / "with_long.jsonl"
    long = {"prompt": [{"role": "user", "content": "many words " * 40}], "env_class": "letters", "charset": "digits"}
    data.write_text((ROOT / "examples/data/rl_digits.jsonl").read_text() + (json.dumps(long) + "\n") * 3)
    cfg = example(tmp_path, {"sampling_params": {"max_generate_length": 16, "temperature": 0.7}},
                  eval_before_train=False, eval_interval=-1, train_batch_size=4, policy_mini_batch_size=4, epochs=1,
                  ckpt_interval=-1, policy=policy, bf16=False)
    cfg.data.train_data = [str(data)]
    with caplog.at_level("WARNING", logger="tx.rl.trainer"):
        trainer = RLTrainer(cfg)
    assert "data.train_data: 3 of 67 prompts are longer than trainer.max_prompt_length=64 tokens" in caplog.text
    assert trainer.full and trainer.policy.backend.precision.param_dtype == "fp32" and trainer.policy.reference is not trainer.policy.backend
    assert trainer.runs[0].cfg.trainer.algorithm.temperature == 0.7
    trajectories = trainer._collect({})["policy"]
    old = trainer._recomputed_logprobs({"policy": trajectories})["policy"]
    sampler = np.zeros_like(old)
    first = trajectories[:4]
    datums = [{"input_ids": (tr.prompt_ids + tr.response_ids)[:-1], "targets": (tr.prompt_ids + tr.response_ids)[1:]}
              for tr in first]
    out = trainer.policy.backend.forward(make_batch([("r", "policy", datums, "cross_entropy", None)],
                                                    all_temperatures=[0.7] * len(first)))["r"]
    for i, (tr, o) in enumerate(zip(first, out.loss_fn_outputs)):
        sampler[i, :len(tr.logprobs)] = tr.logprobs
        want = o["logprobs"].to_numpy()[len(tr.prompt_ids) - 1:]
        np.testing.assert_allclose(old[i, :len(want)], want, atol=1e-5)
    assert np.abs(old[:4] - sampler[:4]).max() > 0.01  # tempered, not the sampler's
    trainer.batches_used = 0
    records = [trainer.train_step() for _ in range(2)]
    assert records[0]["policy/policy_kl"] == 0.0 and records[0]["policy/clip_ratio"] == 0.0, records[0]
    assert records[0]["data/dropped_rows"] == 3
    assert records[1]["policy/policy_kl"] > 0.0, records[1]
    trainer.export(tmp_path / "export")
    assert (tmp_path / "export/policy/config.json").exists()
    assert list((tmp_path / "export/policy").glob("*.safetensors"))
    with pytest.raises(ValidationError, match="rank=0 .full training.*a job of several runs needs LoRA"):
        example(tmp_path, policy=policy, runs=[{"name": "a"}, {"name": "b"}])


@tx.rl.register_env("test_count_turns", replace=True)
class CountTurns(tx.rl.Env):
    """Answers every turn with 'again' until the third, then rewards 1."""

    def init(self, prompt, extras):
        self.turn = 0
        return prompt

    def step(self, action):
        self.turn += 1
        if self.turn == 3:
            return tx.rl.StepOutput(reward=1.0, done=True)
        return tx.rl.StepOutput(observations=[{"role": "user", "content": "again"}], reward=0.25, done=False)


@tx.rl.register_env("test_rewrites_prompt", replace=True)
class RewritesPrompt(tx.rl.Env):
    """Each episode sees its own prompt (a per-episode suffix), as envs that randomize their task do."""

    count = 0

    def init(self, prompt, extras):
        RewritesPrompt.count += 1
        return [{"role": "user", "content": prompt[-1]["content"] + f" (variant {RewritesPrompt.count % 3})"}]

    def step(self, action):
        return tx.rl.StepOutput(reward=1.0, done=True)


def test_multi_turn_episodes_keep_sampled_and_observation_tokens_apart(tmp_path):
    from tx.rl.rollout import rollout

    trainer = RLTrainer(example(tmp_path, {"max_turns": 5, "max_input_length": 200}, eval_before_train=False,
                                eval_interval=-1))
    rows = trainer.train_rows[:2]
    for row in rows:
        row.env_class = "test_count_turns"
    params = trainer.rollout_params["train"]
    trajectories = rollout(trainer.policy, trainer.chat, {"policy": (0, 0)}, rows, params, trainer.pool)["policy"]
    assert len(trajectories) == 2 * params.n_samples
    tokenizer = trainer.chat.tokenizer
    for tr in trajectories:
        assert tr.turn_rewards == [0.25, 0.25, 1.0] and tr.reward == 1.5
        mask = np.asarray(tr.loss_mask)
        observed = tokenizer.decode([t for t, m in zip(tr.response_ids, mask) if not m])
        assert observed.count("again") == 2 and observed.count("<|im_start|>assistant") == 2
        assert np.all(np.asarray(tr.logprobs)[mask == 0] == 0.0)
        assert all(mask[p] == 1 for p in tr.reward_positions)
        # sampled tokens' log-probs are forward's under the same weights
        full = tr.prompt_ids + tr.response_ids
        out = trainer.policy.backend.forward(make_batch([("r", "policy", [{"input_ids": full[:-1], "targets": full[1:]}],
                                                   "cross_entropy", None)]))["r"]
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(tr.prompt_ids) - 1:]
        np.testing.assert_allclose(lp[mask == 1], np.asarray(tr.logprobs)[mask == 1], atol=1e-4)

    # episodes whose env rewrote the prompt are each sampled after their own prompt (not the group's first)
    row = trainer.train_rows[2]
    row.env_class = "test_rewrites_prompt"
    trajectories = rollout(trainer.policy, trainer.chat, {"policy": (0, 0)}, [row], trainer.rollout_params["train"],
                           trainer.pool)["policy"]
    assert len({tuple(tr.prompt_ids) for tr in trajectories}) == 3
    for tr in trajectories:
        full = tr.prompt_ids + tr.response_ids
        out = trainer.policy.backend.forward(make_batch([("r", "policy", [{"input_ids": full[:-1], "targets": full[1:]}],
                                                   "cross_entropy", None)]))["r"]
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(tr.prompt_ids) - 1:]
        np.testing.assert_allclose(lp, tr.logprobs, atol=1e-4)  # sampled after this very prompt


@pytest.mark.parametrize("override, says", [
    ({"trainer": {"placement": {"colocate_all": True}}}, "trainer.placement: not applicable to tx (Ray GPU placement"),
    ({"generator": {"inference_engine": {"backend": "vllm"}}}, "generator.inference_engine: not applicable to tx"),
    ({"trainer": {"critic": {"fsdp_config": {}}}}, "trainer.critic.fsdp_config: not applicable to tx"),
    ({"trainer": {"algorithm": {"advantage_estimator": "gae"}}}, "trainer.critic.model.lora.rank=0"),
    ({"trainer": {"algorithm": {"advantage_estimator": "gae"}, "critic": {"model": {"path": "x"}}}},
     "trainer.critic.model.path='x': tx.rl's critic is an adapter"),
    ({"trainer": {"critic": {"model": {"path": "tiny"}}}}, "trainer.critic.model.path is set but advantage_estimator"),
    ({"trainer": {"algorithm": {"advantage_estimator": "nope"}}}, "advantage_estimator='nope' is not registered"),
    ({"trainer": {"algorithm": {"policy_loss_type": "nope"}}}, "policy_loss_type='nope' is not registered"),
    ({"trainer": {"algorithm": {"use_kl_in_reward": True}}}, "mutually exclusive"),
    ({"trainer": {"train_batch_size": 6, "policy_mini_batch_size": 4}}, "train_batch_size=6 must be a multiple"),
    ({"trainer": {"max_ckpts_to_keep": 0}}, "max_ckpts_to_keep=0"),
    ({"trainer": {"algorithm": {"kl_estimator_type": "k4"}}}, "kl_estimator_type"),
    ({"generator": {"sampling_params": {"temperature": 0.7}}, "tx": {"base_url": "http://127.0.0.1:1"}},
     "trainer.algorithm.temperature=0.7 (default: the sampling temperature): Tinker's forward_backward"),
    ({"trainer": {"typo_field": 1}}, "typo_field"),
])
def test_config_errors_name_the_field(override, says):
    values = {"trainer": {"logger": "console"}}
    for section, fields in override.items():
        values.setdefault(section, {}).update(fields)
    with pytest.raises(ValidationError, match=None) as err:
        RLConfig.model_validate(values)
    assert says in str(err.value), str(err.value)


def test_seed_post_init_rules_and_overrides():
    cfg = load_config(None, ["trainer.logger=console", "trainer.max_prompt_length=100",
                             "generator.sampling_params.max_generate_length=50"])
    assert cfg.generator.max_input_length == 100
    assert cfg.trainer.algorithm.max_seq_len == 150
    assert cfg.trainer.algorithm.temperature == 1.0
    assert cfg.generator.eval_sampling_params.temperature == 0.0
    assert cfg.generator.eval_sampling_params.max_generate_length == 50
    assert cfg.trainer.train_batch_size == 1024 and cfg.generator.n_samples_per_prompt == 5  # the seed's defaults


USER_MODULE = '''
import numpy as np
import tx.rl

CALLS = {"env_steps": 0, "estimator": 0, "loss_traces": 0}


@tx.rl.register_env("user_has_digit")
class HasDigit(tx.rl.Env):
    def step(self, action):
        CALLS["env_steps"] += 1
        return tx.rl.StepOutput(reward=float(any(c.isdigit() for c in action)), done=True)


@tx.rl.register_advantage_estimator("user_centered")
def centered(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    CALLS["estimator"] += 1
    score = token_rewards_bt.sum(1)
    adv = (score - score.mean())[:, None] * response_mask_bt
    return adv.astype(np.float32), adv.astype(np.float32)


@tx.rl.register_policy_loss("user_reinforce", params={"scale": 1.0})
def reinforce(logprobs_t, inputs, params):
    CALLS["loss_traces"] += 1
    return -params["scale"] * inputs["advantages"] * logprobs_t
'''


def test_user_env_estimator_and_policy_loss_from_a_module_in_the_config(tmp_path, monkeypatch):
    import sys

    (tmp_path / "my_rl_parts.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(16)]  # no env_class column
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--config", str(EXAMPLE), "environment.imports=[my_rl_parts]", "environment.env_class=user_has_digit",
                 "trainer.algorithm.advantage_estimator=user_centered", "trainer.algorithm.policy_loss_type=user_reinforce",
                 "trainer.epochs=1", "trainer.eval_before_train=false", "trainer.eval_interval=-1",
                 f"data.train_data=[{tmp_path / 'data.jsonl'}]", "trainer.ckpt_interval=-1",
                 "trainer.hf_save_interval=-1", f"tx.metrics_file={tmp_path}/m.jsonl"]) == 0
    calls = sys.modules["my_rl_parts"].CALLS
    assert calls == {"env_steps": 2 * 8 * 8, "estimator": 2, "loss_traces": calls["loss_traces"]}  # 2 steps of 8 x 8
    assert calls["loss_traces"] >= 1
    records = [yaml.safe_load(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len([r for r in records if "policy/grad_norm" in r]) == 2


