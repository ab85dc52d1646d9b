"""tx.training.schedule: the seed's learning-rate schedules (HF semantics), checked at a few steps against values
worked out by hand from the formulas: linear warmup lr * (s + 1) / warmup, then constant, cosine
lr * (r + (1 - r) * (1 + cos(pi * p)) / 2) or linear lr * (r + (1 - r) * (1 - p)),
p = (s - warmup) / (total - warmup)."""

import pytest

from tx.training.schedule import learning_rate


def test_warmup_then_constant():
    got = [learning_rate(1e-3, s, 100, "constant_with_warmup", warmup_steps=4) for s in (0, 1, 2, 3, 4, 99)]
    assert got == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)
    assert learning_rate(1e-3, 0, 100) == 1e-3  # no warmup: the full rate from the first step


def test_cosine_decays_to_the_floor():
    # warmup 2 of total 10: p = 0 at step 2, 0.5 at step 6, 1 at step 10
    assert learning_rate(1.0, 1, 10, "cosine", 2) == pytest.approx(1.0)  # last warmup step
    assert learning_rate(1.0, 2, 10, "cosine", 2) == pytest.approx(1.0)
    assert learning_rate(1.0, 4, 10, "cosine", 2) == pytest.approx(0.5 * (1 + 2 ** -0.5))  # p = 0.25
    assert learning_rate(1.0, 6, 10, "cosine", 2) == pytest.approx(0.5)
    assert learning_rate(1.0, 10, 10, "cosine", 2) == pytest.approx(0.0, abs=1e-15)
    assert learning_rate(1.0, 6, 10, "cosine", 2, min_lr_ratio=0.1) == pytest.approx(0.55)
    assert learning_rate(1.0, 10, 10, "cosine", 2, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_linear_decay():
    assert [learning_rate(2.0, s, 4, "linear") for s in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    assert learning_rate(2.0, 2, 4, "linear", min_lr_ratio=0.5) == pytest.approx(2.0 * (0.5 + 0.5 * 0.5))


def test_min_lr_ratio_zero_is_the_plain_decay():
    """RL's optimizer_config has no min_lr_ratio (the seed has none): the default 0 must give the plain decay."""
    for scheduler in ("cosine", "linear"):
        for step in range(0, 12):
            plain = learning_rate(3e-4, step, 12, scheduler, 3)
            assert plain == learning_rate(3e-4, step, 12, scheduler, 3, min_lr_ratio=0.0)
    assert learning_rate(1.0, 0, 1, "cosine") == 1.0  # total == warmup: no division by zero
