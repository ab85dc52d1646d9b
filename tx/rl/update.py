"""One RL update's host side, per run: the run itself (`Run`: its config, loss parameters, KL controller and
off-policy correction), its batch prepared for training (rewards and filters, KL in the reward, advantages and
returns, off-policy correction: `prepare`), its mini-batches as datums of the "tx.rl" objective with the loss
reduction placed in the weights or the advantages (`minibatch`), and the metrics of a mini-batch's pass
(`loss_metrics`). The trainer (`tx.rl.trainer`) calls these between its device calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tx.rl import algorithms, critic, objective
from tx.rl.batch import datum, per_target, response_arrays
from tx.rl.config import RLConfig
from tx.rl.rollout import Trajectory


@dataclass
class Run:
    """One RL experiment of the job: its adapter (model id = name), its effective config and algorithm state."""

    name: str
    cfg: RLConfig
    loss_params: dict[str, float]
    kl_ctrl: algorithms.KLController
    correction: algorithms.OffPolicyCorrection

    @property
    def critic(self) -> str | None:
        """The model id of its critic (`gae` runs), else None."""
        return critic.critic_id(self.name) if self.cfg.trainer.algorithm.advantage_estimator == "gae" else None

    @classmethod
    def build(cls, name: str, cfg: RLConfig) -> Run:
        a = cfg.trainer.algorithm
        return cls(name, cfg, a.policy_loss_params(),
                   algorithms.KLController(a.kl_ctrl.type, a.kl_loss_coef, a.kl_ctrl.kl_target, a.kl_ctrl.horizon),
                   a.correction())


def recomputes_old(run: Run, full: bool) -> bool:
    """Whether `run`'s old log-probs come from a forward of its weights rather than from the sampler: at a
    training temperature (the sampler's are untempered), in full training (bf16 weights: the decode loop and the
    training pass round differently), and whenever the off-policy correction is on (its ratio old / rollout
    is what it corrects; with old = rollout it would be 1 and never act)."""
    return run.cfg.trainer.algorithm.temperature != 1.0 or full or run.correction.enabled


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
    return datums, objective.OBJECTIVE, config


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
