"""The engine's per-run loss history (`tx.engine.telemetry.LossHistory`), read by the console's
GET /api/v1/training_runs/{id}/loss_history: forward_backward results add up until the run's optim_step closes the
step; steps and runs are bounded (oldest steps, least recently trained runs dropped first)."""

from __future__ import annotations

import pytest

from tx.engine.telemetry import LossHistory


def test_steps_add_up_the_forward_backward_calls_before_each_optim_step():
    h = LossHistory()
    h.forward_backward("m", {"loss:sum": 3.0, "n:sum": 2.0, "gnorm:mean": 1.5}, tokens=10)
    h.forward_backward("m", {"loss:sum": 1.0, "n:sum": 1.0, "gnorm:mean": 0.5}, tokens=6)
    h.forward_backward("other", {"loss:sum": 9.0}, tokens=1)
    steps, pending = h.of("m")
    assert steps == [] and pending.loss_sum == 4.0 and pending.passes == 2
    h.optim_step("m", {"grad_norm": 0.25}, now=100.0)
    steps, pending = h.of("m")
    assert pending is None
    (s,) = steps
    assert (s.step, s.time, s.loss_sum, s.tokens, s.passes) == (1, 100.0, 4.0, 16, 2)
    assert s.metrics == {"n:sum": 3.0, "gnorm:mean": 0.5, "optim/grad_norm": 0.25}  # sums add, the rest: last
    h.optim_step("m", {}, now=101.0)  # a step with no forward_backward
    assert [(s.step, s.loss_sum, s.passes) for s in h.of("m")[0]] == [(1, 4.0, 2), (2, 0.0, 0)]
    assert h.of("other")[0] == [] and h.of("other")[1].loss_sum == 9.0
    assert h.of("unknown") == ([], None)


def test_copies_are_not_the_live_records():
    h = LossHistory()
    h.forward_backward("m", {"loss:sum": 1.0}, tokens=1)
    h.optim_step("m", {})
    h.of("m")[0][0].metrics["x"] = 1.0
    assert h.of("m")[0][0].metrics == {}


@pytest.mark.parametrize("steps", [1, 5])
def test_bounded_steps_and_runs(steps):
    h = LossHistory(max_steps=3, max_models=2)
    for i in range(steps):
        h.forward_backward("a", {"loss:sum": float(i)}, tokens=1)
        h.optim_step("a", {})
    assert [s.step for s in h.of("a")[0]] == list(range(max(1, steps - 2), steps + 1))
    h.optim_step("b", {})
    h.optim_step("a", {})  # a trained again: b is now the least recent
    h.optim_step("c", {})
    assert h.of("b") == ([], None) and h.of("a")[0] and h.of("c")[0]
