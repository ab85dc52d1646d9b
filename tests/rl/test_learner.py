"""tx.rl.learner: the one mini-batch loop of the policy and critic updates, on a recording fake policy: one
forward_backward per mini-batch holding every learner's request, then one AdamW step per learner at its
schedule's learning rate (optimizer steps counted from `first_step`), metrics averaged per learner."""

import numpy as np
import pytest

from tx.rl.learner import Learner, train
from tx.rl.policy import PassResult
from tx.training.seed_config import OptimizerConfig


class FakePolicy:
    def __init__(self):
        self.calls = []

    def forward_backward(self, requests):
        self.calls.append(("fb", {k: v[0] for k, v in requests.items()}))
        return {k: PassResult(loss_sum=float(sum(v[0])), outputs=[]) for k, v in requests.items()}

    def optim_step(self, name, adam):
        self.calls.append(("adam", name, adam.learning_rate, adam.beta1, adam.weight_decay))
        return 10.0 * len(self.calls)


def learner(model_id: str, opt: OptimizerConfig) -> Learner:
    return Learner(model_id, opt, lambda idx: (idx.tolist(), "loss", {}),
                   lambda idx, result, lr, grad_norm: {"loss": result.loss_sum, "lr": lr, "grad_norm": grad_norm})


def test_one_pass_per_mini_batch_then_an_adam_step_per_learner():
    policy = FakePolicy()
    linear = OptimizerConfig(lr=1.0, scheduler="linear", adam_betas=[0.8, 0.9], weight_decay=0.0)
    constant = OptimizerConfig(lr=0.5)
    out = train(policy, {"a": learner("a", linear), "b": learner("b-critic", constant)}, rows=5, rows_per_mini=2,
                epochs=2, first_step=6, total_steps=12)
    minis = [[0, 1], [2, 3], [4]] * 2
    want, grad = [], {"a": [], "b": []}
    for i, idx in enumerate(minis):
        step = 6 + i
        want.append(("fb", {"a": idx, "b-critic": idx}))
        want.append(("adam", "a", round(1 - step / 12, 12), 0.8, 0.0))
        grad["a"].append(10.0 * len(want))
        want.append(("adam", "b-critic", 0.5, 0.9, 0.01))
        grad["b"].append(10.0 * len(want))
    assert [c if c[0] == "fb" else (*c[:2], round(c[2], 12), *c[3:]) for c in policy.calls] == want
    losses = [float(sum(idx)) for idx in minis]
    assert out["a"] == pytest.approx({"loss": np.mean(losses), "lr": np.mean([1 - (6 + i) / 12 for i in range(6)]),
                                      "grad_norm": np.mean(grad["a"])})
    assert out["b"] == pytest.approx({"loss": np.mean(losses), "lr": 0.5, "grad_norm": np.mean(grad["b"])})
