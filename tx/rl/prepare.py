"""Rewards -> advantages, pure numpy, per run: a batch of episodes becomes the arrays one RL update trains on
(rewards with `zero_reward_on_non_stop`, `apply_overlong_filtering` and `zero_variance_filter`, KL in the reward,
advantages and returns from the run's estimator, batch normalisation, off-policy correction) and their metrics.
The device inputs (reference and recomputed old log-probs, a critic's values) come in as arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from tx.rl import algorithms
from tx.rl.batch import response_arrays
from tx.rl.rollout import Trajectory
from tx.rl.runs import Run


def prepare(run: Run, trajectories: list[Trajectory], ref: np.ndarray | None, values: np.ndarray | None,
            old: np.ndarray | None = None) -> tuple[dict, dict]:
    """Rewards, filters, KL in reward, advantages (and returns, with a critic's `values`) and off-policy
    correction of one run's batch. `old`: the recomputed old log-probs (`recomputes_old`), else None: the
    sampler's. The correction's ratio is exp(old - rollout), rollout = the sampler's log-probs."""
    g, a = run.cfg.generator, run.cfg.trainer.algorithm
    arrays = response_arrays(trajectories)
    metrics: dict[str, Any] = {}
    stopped = np.array([tr.stop_reason == "stop" for tr in trajectories])
    if g.zero_reward_on_non_stop:
        arrays["rewards"][~stopped] = 0.0
    if g.apply_overlong_filtering:
        arrays["mask"][~stopped] = 0.0
    group_b = np.array([tr.group for tr in trajectories])
    if a.zero_variance_filter:
        keep = algorithms.zero_variance_mask(arrays["rewards"].sum(1), group_b)
        arrays["mask"][~keep] = 0.0
        metrics["filtered_zero_variance_rows"] = int((~keep).sum())
    ref = np.zeros_like(arrays["logprobs"]) if ref is None else ref
    rollout_lp = arrays["logprobs"]  # the sampler's log-probs of the tokens it chose
    if old is None:
        old = rollout_lp  # forward's log-probs under the weights that sampled
    if a.use_kl_in_reward:
        kl_bt = np.asarray(algorithms.kl_estimate(a.kl_estimator_type, old, ref)) * arrays["mask"]
        arrays["rewards"], current = algorithms.apply_kl_in_reward(arrays["rewards"], kl_bt, arrays["mask"],
                                                                   run.kl_ctrl.value)
        metrics |= {"loss/avg_kl": current, "loss/kl_loss_coef": run.kl_ctrl.value}
        run.kl_ctrl.update(current, len(trajectories))
    advantages, returns = algorithms.compute_advantages(
        a.advantage_estimator, arrays["rewards"], arrays["response"], group_b, values_bt=values,
        params=algorithms.EstimatorParams(gamma=a.gamma, lambd=a.lambd, grpo_norm_by_std=a.grpo_norm_by_std))
    if a.advantage_batch_normalize:
        advantages = algorithms.batch_normalize_advantages(advantages, arrays["mask"])
    tis, mask, correction = algorithms.apply_off_policy_correction(run.correction, old, rollout_lp, arrays["mask"])
    metrics |= {f"policy/{k}": v for k, v in correction.items()}
    metrics["loss/avg_raw_advantages"] = float((advantages * mask).sum() / max(mask.sum(), 1))
    if a.use_kl_loss or a.use_kl_in_reward:
        kl = np.asarray(algorithms.kl_estimate(a.kl_estimator_type, old, ref), np.float64)
        metrics["policy/policy_kl"] = float((kl * algorithms.sequence_mean_weights(mask)).sum())
    prep = {"advantages": advantages, "old": old, "rollout": rollout_lp, "ref": ref, "mask": mask, "tis": tis,
            "loss_mask": arrays["mask"], "group": group_b}
    if values is not None:
        prep |= {"values": values, "returns": returns}
        metrics |= {"critic/values_mean": float((values * mask).sum() / max(mask.sum(), 1)),
                    "critic/returns_mean": float((returns * mask).sum() / max(mask.sum(), 1))}
    return prep, metrics
