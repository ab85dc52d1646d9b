"""The policy update's host side, per run: its mini-batches as datums of the policy loss's objective (`tx.rl.objective`) with the loss
reduction placed in the weights or the advantages (`minibatch`), the metrics of a mini-batch's pass
(`loss_metrics`), and both as the run's `Learner` for the mini-batch loop (`tx.rl.learner`). The batch they read
is `tx.rl.prepare`'s."""

from __future__ import annotations

import numpy as np

from tx.rl import algorithms, objective
from tx.rl.batch import datum, from_targets, per_target
from tx.rl.learner import Learner
from tx.rl.policy import PassResult
from tx.rl.rollout import Trajectory
from tx.rl.runs import Run


def minibatch(run: Run, trajectories: list[Trajectory], prep: dict, idx: np.ndarray, rng: np.random.Generator
              ) -> tuple[list[dict], str, dict[str, float]]:
    """One run's mini-batch as datums of its training loss: the `loss_reduction` over the mini-batch in the
    weights (placement "loss") or the advantages ("advantages"), times the off-policy correction's TIS factors
    on the corrected mask."""
    a, t = run.cfg.trainer.algorithm, run.cfg.trainer
    m, old = prep["mask"][idx], prep["old"]
    adv = placed_advantages(run, prep, idx)
    if a.loss_reduction_placement == "loss":
        weights = algorithms.reduction_weights(a.loss_reduction, m, a.max_seq_len, prep["group"][idx],
                                               t.micro_train_batch_size_per_gpu)
    else:
        weights = m
    weights = weights * prep["tis"][idx]
    kl_weights = algorithms.sequence_mean_weights(m) if a.use_kl_loss else np.zeros_like(m)
    entropy_weights = algorithms.reduction_weights("token_mean", m)  # SkyRL: the entropy's masked token mean
    selected = np.zeros_like(m)
    if a.policy_loss_type in ("clip_cov", "kl_cov"):
        selected = algorithms.select_cov_tokens(a.policy_loss_type, old[idx], adv, m, run.loss_params, rng)
    datums = []
    for j, i in enumerate(idx):
        tr = trajectories[i]
        datums.append(datum(tr) | {
            "temperature": a.temperature, "weights": per_target(tr, weights[j]), "logprobs": per_target(tr, old[i]),
            "advantages": per_target(tr, adv[j]),
            "extra": {"ref_logprobs": per_target(tr, prep["ref"][i]), "kl_weights": per_target(tr, kl_weights[j]),
                      "entropy_weights": per_target(tr, entropy_weights[j]), "rl_mask": per_target(tr, m[j]),
                      "rl_selected": per_target(tr, selected[j]),
                      "rl_rollout_logprobs": per_target(tr, prep["rollout"][i])}})
    config = objective.objective_config(a.policy_loss_type, a.kl_estimator_type, run.loss_params,
                                        a.kl_loss_coef if a.use_kl_loss else 0.0,
                                        a.entropy_loss_coef if a.use_entropy_loss else 0.0)
    return datums, objective.objective_name(a.policy_loss_type), config


def placed_advantages(run: Run, prep: dict, idx: np.ndarray) -> np.ndarray:
    """The mini-batch's advantages as the loss reads them: as computed (placement "loss"), or scaled by the
    reduction's factor from the mask before off-policy correction (placement "advantages", SkyRL 0.4.0)."""
    a, t = run.cfg.trainer.algorithm, run.cfg.trainer
    if a.loss_reduction_placement == "loss":
        return prep["advantages"][idx]
    return algorithms.reduction_in_advantages(a.loss_reduction, prep["advantages"][idx], prep["loss_mask"][idx],
                                              a.max_seq_len, prep["group"][idx], t.micro_train_batch_size_per_gpu)


def loss_metrics(run: Run, prep: dict, idx: np.ndarray, current: np.ndarray, entropy: np.ndarray
                 ) -> dict[str, float]:
    """A mini-batch's clip ratio (cispo: also SkyRL's `cispo/ratio_*`) and policy entropy, from the log-probs
    and entropy its forward_backward returned."""
    a = run.cfg.trainer.algorithm
    m, old, rollout_lp = prep["mask"][idx], prep["old"][idx], prep["rollout"][idx]
    out = {"policy/clip_ratio": algorithms.clip_fraction(
        a.policy_loss_type, current, old, placed_advantages(run, prep, idx), m, run.loss_params,
        rollout_logprobs_bt=rollout_lp)}
    if a.policy_loss_type == "cispo":
        cispo = algorithms.cispo_metrics(current, old, m, run.loss_params, rollout_logprobs_bt=rollout_lp)
        out |= {f"policy/{k}": v for k, v in cispo.items() if k != "clip_ratio"}
    out["policy/policy_entropy"] = float((entropy * m).sum() / max(m.sum(), 1))
    return out


def learner(run: Run, trajectories: list[Trajectory], prep: dict, rng: np.random.Generator) -> Learner:
    """`run`'s policy in the mini-batch loop: its `minibatch` requests, and per mini-batch the loss metrics of the
    log-probs and entropy the pass returned, the loss, gradient norm and learning rate."""
    width = prep["mask"].shape[1]

    def metrics(idx: np.ndarray, result: PassResult, lr: float, grad_norm: float) -> dict[str, float]:
        rows = [trajectories[i] for i in idx]
        current = from_targets(rows, [o["logprobs"] for o in result.outputs], width)
        entropy = from_targets(rows, [o["entropy"] for o in result.outputs], width)
        return loss_metrics(run, prep, idx, current, entropy) | {
            "policy/policy_loss": result.loss_sum, "policy/grad_norm": grad_norm, "policy/policy_lr": lr}

    return Learner(run.name, run.cfg.trainer.policy.optimizer_config,
                   lambda idx: minibatch(run, trajectories, prep, idx, rng), metrics)
