"""tx.rl through the service: the same trainer, driving a real `python -m tx.run --import tx.rl` subprocess with
the official tinker SDK (`tx.base_url`), gives the in-process trainer's numbers — rewards, loss, gradient norm,
the critic's (PPO with GAE: a second training client whose value head comes back through `forward`), and at
step 2 (sampled with the updated weights, scored by the base model's compute_logprobs) the KL; and resuming
from the server-side checkpoints (policy and critic, with their optimizers) repeats the next step."""

import pytest

from tests.api.server_proc import API_KEY, CLIENTS, Server
from tests.rl.test_trainer import example
from tx.rl.trainer import RLTrainer

KEYS = ("reward/avg_raw_reward", "generate/avg_num_tokens", "policy/policy_loss", "policy/grad_norm",
        "policy/policy_kl", "policy/policy_entropy", "policy/clip_ratio", "critic/critic_loss", "critic/grad_norm",
        "critic/values_mean", "critic/returns_mean")


def test_trainer_through_the_service_equals_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    trainer = {"policy": {"model": {"path": "tiny", "lora": {"rank": 8, "alpha": 32, "target_modules": "all-linear"}},
                       "optimizer_config": {"lr": 2e-2, "weight_decay": 0.0}},
            "critic": {"model": {"lora": {"rank": 4, "alpha": 32}}, "optimizer_config": {"lr": 1e-2}},
            "critic_mini_batch_size": 2}

    def config(name, resume_path=None, **tx_settings):
        cfg = example(tmp_path / name, {"n_samples_per_prompt": 4}, eval_before_train=False, eval_interval=-1,
                      ckpt_interval=-1, hf_save_interval=-1, train_batch_size=4, policy_mini_batch_size=4,
                      algorithm={"advantage_estimator": "gae", "lambd": 0.95}, **trainer,
                      **({"resume_mode": "from_path", "resume_path": str(resume_path)} if resume_path else {}))
        return cfg.model_copy(update={"tx": cfg.tx.model_copy(update=tx_settings)})

    local = RLTrainer(config("local"))
    want = [local.train_step() for _ in range(2)]
    server = Server(tmp_path / "server", "--import", "tx.rl")
    try:
        remote = RLTrainer(config("remote", base_url=server.url))
        CLIENTS.setdefault(server.url, []).append(remote.policy.service)
        got = [remote.train_step() for _ in range(2)]
        # checkpoints are the server's (save_state; the local step dir records their tinker:// paths): a new
        # trainer resuming from them takes the same third step
        step_dir = remote.save()
        third = remote.train_step()
        again = RLTrainer(config("again", resume_path=step_dir, base_url=server.url))
        CLIENTS[server.url].append(again.policy.service)
        again.resume()
        assert again.global_step == 2
        again_third = again.train_step()
    finally:
        assert server.stop() in (0, -15, 143), server.log()
    assert want[1]["policy/policy_kl"] > 0  # step 2 reads the reference log-probs for real
    assert want[1]["critic/values_mean"] != 0  # and the critic's values after its first update
    for w, g in zip(want + [third], got + [again_third]):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (w["step"], key, w[key], g[key])


def test_run_refuses_an_import_it_cannot_load(capsys):
    from tx.run import main

    with pytest.raises(SystemExit):
        main(["--import", "tx_no_such_module", "--port", "1"])
    assert "--import tx_no_such_module: No module named 'tx_no_such_module'" in capsys.readouterr().err
