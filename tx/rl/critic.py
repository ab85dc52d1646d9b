"""`gae`'s critic in tx: per run, a LoRA adapter with a scalar value head on the policy's base model (model id
`<run>-critic`), living in the same backend (or server) as the policy. Its values before the update feed GAE;
then it trains on the value loss (`tx.rl.value`: PPO's clipped value loss against the GAE returns; SkyRL's
reduction: each sequence's masked mean, then the mean over the mini-batch's sequences), with its own optimizer
(`trainer.critic.optimizer_config`) and mini-batches of `trainer.critic_mini_batch_size` prompts, in the same
mini-batch loop as the policy (`learner`, for `tx.rl.learner`). Its cost: one LoRA adapter and a [hidden]
vector, and one more forward over the batch (the old values) plus its own training passes.
"""

from __future__ import annotations

import numpy as np

from tx.rl import algorithms
from tx.rl.batch import datum, from_targets, per_target
from tx.rl.learner import Learner
from tx.rl.objective import VALUE_OBJECTIVE
from tx.rl.policy import LocalPolicy, PassResult, RemotePolicy
from tx.rl.rollout import Trajectory
from tx.training.seed_config import OptimizerConfig


def critic_id(run_name: str) -> str:
    return f"{run_name}-critic"


def old_values(policy: LocalPolicy | RemotePolicy, by_critic: dict[str, list[Trajectory]]) -> dict[str, np.ndarray]:
    """V [B, T] (response-aligned: the state before each response token) of each critic's episodes, one forward."""
    out = policy.forward({cid: ([datum(tr) for tr in trs], VALUE_OBJECTIVE, {"value_clip": 0.0})
                          for cid, trs in by_critic.items()})
    return {cid: from_targets(trs, [o["values"] for o in out[cid].outputs]) for cid, trs in by_critic.items()}


def value_datums(trajectories: list[Trajectory], idx: np.ndarray, prep: dict, value_clip: float
                 ) -> tuple[list[dict], str, dict]:
    """One critic mini-batch: rows `idx`, weights = SkyRL's `masked_mean(loss, mask, dim=-1).mean()` over the
    mini-batch (a per-sequence mean, then the batch mean; fully masked rows count in the batch mean as 0)."""
    m = prep["mask"][idx]
    weights = algorithms.sequence_mean_weights(m)
    datums = []
    for j, i in enumerate(idx):
        tr = trajectories[i]
        datums.append(datum(tr) | {"weights": per_target(tr, weights[j]), "extra": {
            "returns": per_target(tr, prep["returns"][i]), "old_values": per_target(tr, prep["values"][i])}})
    return datums, VALUE_OBJECTIVE, {"value_clip": float(value_clip)}


def learner(model_id: str, optimizer: OptimizerConfig, trajectories: list[Trajectory], prep: dict,
            value_clip: float) -> Learner:
    """A critic in the mini-batch loop: its `value_datums` requests, and per mini-batch the value loss, gradient
    norm, learning rate and the fraction of values the clip acted on."""
    width = prep["mask"].shape[1]

    def metrics(idx: np.ndarray, result: PassResult, lr: float, grad_norm: float) -> dict[str, float]:
        current = from_targets([trajectories[i] for i in idx], [o["values"] for o in result.outputs], width)
        clipfrac = algorithms.value_clip_fraction(current, prep["values"][idx], prep["returns"][idx],
                                                  prep["mask"][idx], value_clip)
        return {"critic/critic_loss": result.loss_sum, "critic/grad_norm": grad_norm, "critic/critic_lr": lr,
                "critic/vf_clipfrac": clipfrac}

    return Learner(model_id, optimizer, lambda idx: value_datums(trajectories, idx, prep, value_clip), metrics)
