"""The one mini-batch update loop of an RL step, used by the policy update and the critic update alike.

`update_epochs_per_batch` passes over the batch's rows in mini-batches; each mini-batch is one forward_backward
holding every learner's request (a learner: one adapter, a run's policy or its critic), then one AdamW step per
learner at its schedule's learning rate. What a learner sends and what it reads back are its own (`Learner`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tx import types
from tx.rl.policy import Datum, LocalPolicy, PassResult, RemotePolicy
from tx.training.schedule import learning_rate
from tx.training.seed_config import OptimizerConfig


@dataclass(frozen=True)
class Learner:
    """One adapter the loop trains: its model id and optimizer, its request for a mini-batch's rows, and the
    metrics of that mini-batch from the pass's result, the learning rate and the gradient norm."""

    model_id: str
    optimizer: OptimizerConfig
    request: Callable[[np.ndarray], tuple[list[Datum], str, dict]]
    metrics: Callable[[np.ndarray, PassResult, float, float], dict[str, float]]


def adam_step(policy: LocalPolicy | RemotePolicy, model_id: str, opt: OptimizerConfig, step: int, total: int
              ) -> tuple[float, float]:
    """One AdamW step of `model_id` at the schedule's learning rate for optimizer step `step` of `total`:
    (learning rate, gradient norm)."""
    lr = learning_rate(opt.lr, step, total, opt.scheduler, opt.num_warmup_steps)
    return lr, policy.optim_step(model_id, types.AdamParams(
        learning_rate=lr, beta1=opt.adam_betas[0], beta2=opt.adam_betas[1], weight_decay=opt.weight_decay,
        grad_clip_norm=opt.max_grad_norm))


def train(policy: LocalPolicy | RemotePolicy, learners: dict[str, Learner], rows: int, rows_per_mini: int,
          epochs: int, first_step: int, total_steps: int) -> dict[str, dict[str, float]]:
    """`epochs` passes over `rows` rows in mini-batches of `rows_per_mini`, every learner in each one; the
    optimizer steps count from `first_step` of `total_steps`. Returns each learner's metrics (keyed as
    `learners`), averaged over its mini-batches."""
    sums: dict[str, dict[str, list[float]]] = {name: {} for name in learners}
    step = first_step
    for _ in range(epochs):
        for lo in range(0, rows, rows_per_mini):
            idx = np.arange(lo, min(lo + rows_per_mini, rows))
            out = policy.forward_backward({ln.model_id: ln.request(idx) for ln in learners.values()})
            for name, learner in learners.items():
                lr, grad_norm = adam_step(policy, learner.model_id, learner.optimizer, step, total_steps)
                for key, value in learner.metrics(idx, out[learner.model_id], lr, grad_norm).items():
                    sums[name].setdefault(key, []).append(value)
            step += 1
    return {name: {k: float(np.mean(v)) for k, v in s.items()} for name, s in sums.items()}
