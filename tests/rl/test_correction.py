"""The off-policy correction acts in the trainer: where the old log-probs are not the sampler's (a training
temperature; full training in bf16), one RL step's mini-batch carries the token TIS weights and the outlier and
geometric sequence masks computed from the recorded rollout log-probs, and its loss is the corrected one. The
reference is a loop over rows and tokens in numpy (SkyRL's order: outlier rows, TIS, sequence mask), from the
sampler's log-probs the trajectories recorded and the old log-probs the trainer sent; the loss is checked on the
log-probs forward_backward returned (PPO clip, token mean)."""

import math

import numpy as np
import pytest

from tests.rl.test_trainer import example
from tx.rl.trainer import RLTrainer


def correction(cap: float, outlier: tuple[float, float], geo: tuple[float, float]) -> dict:
    """Token TIS capped at `cap`, outlier rows outside `outlier`, geometric sequence mask outside `geo`."""
    return {"tis_ratio_type": "token", "token_tis_ratio_clip_high": cap, "sequence_mask_metric": "geometric",
            "outlier_token_is_threshold_low": outlier[0], "outlier_token_is_threshold_high": outlier[1],
            "geo_mask_low": geo[0], "geo_mask_high": geo[1]}


def corrected_step(trainer: RLTrainer):
    """One train_step, recording its episodes and its first forward_backward (requests and outputs)."""
    seen = {}
    collect, forward_backward = trainer._collect, trainer.policy.forward_backward

    def record_collect(record):
        seen["episodes"] = collect(record)
        return seen["episodes"]

    def record_fb(requests):
        out = forward_backward(requests)
        seen.setdefault("fb", (requests, out))
        return out

    trainer._collect, trainer.policy.forward_backward = record_collect, record_fb
    metrics = trainer.train_step()
    return metrics, seen["episodes"]["policy"], *seen["fb"]


def numpy_correction(rollout, old, mask, cfg):
    """(tis, mask) per row, loops: rho_t = exp(clip(old - rollout, -20, 20))."""
    tis, out = [], []
    for r_row, o_row, m_row in zip(rollout, old, mask):
        d = [min(max(o - r, -20.0), 20.0) for o, r in zip(o_row, r_row)]
        rho = [math.exp(x) for x in d]
        m = list(m_row)
        if any(mt > 0 and (p > cfg["outlier_token_is_threshold_high"] or p < cfg["outlier_token_is_threshold_low"])
               for p, mt in zip(rho, m)):
            m = [0.0] * len(m)
        w = [min(p, cfg["token_tis_ratio_clip_high"]) for p in rho]
        n = sum(m)
        geo = math.exp(min(max(sum(x * mt for x, mt in zip(d, m)) / max(n, 1.0), -20.0), 20.0))
        if not cfg["geo_mask_low"] <= geo <= cfg["geo_mask_high"]:
            m = [0.0] * len(m)
        tis.append(w)
        out.append(m)
    return tis, out


def check_step(trainer: RLTrainer, cfg: dict):
    metrics, episodes, requests, out = corrected_step(trainer)
    datums, _, config = requests["policy"]
    rollout = [tr.logprobs for tr in episodes]
    masks = [[float(x) for x in tr.loss_mask] for tr in episodes]
    starts = [len(tr.prompt_ids) - 1 for tr in episodes]
    old = [d["logprobs"][s:] for d, s in zip(datums, starts)]
    # the old log-probs are the trainer's forward, not the sampler's
    assert max(abs(o - r) for o_row, r_row in zip(old, rollout) for o, r in zip(o_row, r_row)) > 0.01
    tis, corrected = numpy_correction(rollout, old, masks, cfg)
    kept = sum(any(m) for m in corrected)
    assert 0 < kept < sum(any(m) for m in masks), "the masks must drop some rows, not all"
    cap = cfg["token_tis_ratio_clip_high"]
    assert any(w == cap for row, m in zip(tis, corrected) for w, mt in zip(row, m) if mt), "the TIS cap must act"
    total = sum(sum(m) for m in corrected)
    weights = [[mt / total * w for mt, w in zip(m, row)] for m, row in zip(corrected, tis)]
    for d, s, want, m, r in zip(datums, starts, weights, corrected, rollout):
        np.testing.assert_allclose(d["weights"][s:], want, rtol=1e-5, atol=1e-8)
        np.testing.assert_array_equal(d["extra"]["rl_mask"][s:], m)
        np.testing.assert_array_equal(d["extra"]["rl_rollout_logprobs"][s:], np.asarray(r, np.float64))
    # the loss forward_backward computed is the corrected one (PPO clip, eps 0.2), not the uncorrected one
    lo, hi = 1 - config["eps_clip_low"], 1 + config["eps_clip_high"]
    loss = plain = 0.0
    plain_total = sum(sum(m) for m in masks)
    for d, s, w, m, o in zip(datums, starts, weights, masks, out["policy"].outputs):
        for t, (lp, old_t, adv) in enumerate(zip(o["logprobs"][s:], d["logprobs"][s:], d["advantages"][s:])):
            ratio = math.exp(lp - old_t)
            pg = max(-adv * ratio, -adv * min(max(ratio, lo), hi))
            loss += w[t] * pg
            plain += m[t] / plain_total * pg
    assert out["policy"].loss_sum == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert abs(loss - plain) > 0.05 * abs(plain) + 1e-4, (loss, plain)
    assert metrics["policy/outlier_seq_masked_ratio"] > 0 or metrics["policy/geo_sequence_mask_masked_ratio"] > 0


def test_tempered_lora_step_applies_token_tis_outlier_and_geometric_masks(tmp_path):
    """Sampling at 0.7 (algorithm.temperature follows): old = a forward at 0.7, rollout = the sampler's
    (untempered: rho is in [0.4, 2.7] here)."""
    cfg = correction(1.5, (0.45, 2.3), (0.9, 1.25))
    trainer = RLTrainer(example(
        tmp_path, {"sampling_params": {"max_generate_length": 16, "temperature": 0.7}},
        algorithm={"off_policy_correction": cfg, "use_kl_loss": False}, eval_before_train=False, eval_interval=-1,
        train_batch_size=4, policy_mini_batch_size=4, ckpt_interval=-1, hf_save_interval=-1))
    check_step(trainer, cfg)


def test_bf16_full_training_step_applies_token_tis_outlier_and_geometric_masks(tmp_path):
    """lora.rank=0 in bf16: the training pass and the decode loop round differently, so old != rollout (rho is
    in [0.96, 1.04] here)."""
    cfg = correction(1.01, (0.98, 1.03), (0.997, 1.003))
    policy = {"model": {"path": "tiny", "lora": {"rank": 0}}, "optimizer_config": {"lr": 1e-4, "weight_decay": 0.0}}
    trainer = RLTrainer(example(
        tmp_path, {"sampling_params": {"max_generate_length": 16}}, policy=policy, bf16=True,
        algorithm={"off_policy_correction": cfg, "use_kl_loss": False}, eval_before_train=False, eval_interval=-1,
        train_batch_size=4, policy_mini_batch_size=4, ckpt_interval=-1, hf_save_interval=-1))
    check_step(trainer, cfg)
