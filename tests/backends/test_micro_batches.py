"""Token-budgeted micro-batches (issue 13 #3): the planner against a brute force over every partition,
the issue's mixed-length round (padded <= 1.5x real tokens, counted in the backend's metrics), results and
gradients equal to one big batch, an over-budget row running alone, and a bounded number of shapes."""

import numpy as np
import pytest

from tests.backends.test_jax_backend import _assert_close_trees, ce_request, new_backend
from tests.helpers import make_batch, random_datums
from tx import types
from tx.backends.batching import CALL_COST_TOKENS, plan_micro_batches

# ---- an independent statement of the shape rules, for the brute force ----


def length_bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... that holds n tokens."""
    candidates = sorted({16} | {b for p in range(4, 20) for b in (2**p, 3 * 2 ** (p - 1))})
    return next(b for b in candidates if b >= n)


def row_bucket(n: int, multiple: int, cap: int) -> int:
    rows = multiple
    while rows < n:
        rows *= 2
    return min(rows, cap) if cap else rows


def group_cost(lengths, group, budget, cap, multiple, new_shape_cost=0):
    """Padded tokens + one call + one compile of a group, or None when the group is not allowed: over the
    row cap, or over the budget while bigger than one row bucket."""
    if cap and len(group) > cap:
        return None
    seq = length_bucket(max(lengths[i] for i in group))
    tokens = row_bucket(len(group), multiple, cap) * seq
    if tokens > budget and tokens > row_bucket(1, multiple, cap) * seq:
        return None
    return tokens + CALL_COST_TOKENS + new_shape_cost


def partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def brute_force_cost(lengths, budget, cap, multiple, new_shape_cost):
    best = None
    for part in partitions(list(range(len(lengths)))):
        costs = [group_cost(lengths, g, budget, cap, multiple, new_shape_cost) for g in part]
        if None not in costs and (best is None or sum(costs) < best):
            best = sum(costs)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_an_optimal_partition_within_the_budget(seed):
    """Against every partition of up to 7 rows (not only runs of the sorted order): the planner's cost is
    the least there is, every group is allowed, and rows come longest first."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    lengths = [int(x) for x in rng.choice([1, 5, 16, 17, 30, 40, 70, 100, 200, 300, 700], n)]
    budget = int(rng.choice([64, 256, 512, 2048]))
    cap = int(rng.choice([0, 0, 2, 4]))
    multiple = int(rng.choice([1, 1, 2]))
    compile_cost = int(rng.choice([0, 100, 1000]))  # no shape compiled yet: every call pays it
    plan = plan_micro_batches(lengths, budget, cap, multiple, new_shape_cost=compile_cost)
    assert sorted(i for g in plan for i in g) == list(range(n))
    costs = [group_cost(lengths, g, budget, cap, multiple, compile_cost) for g in plan]
    case = (lengths, budget, cap, multiple, compile_cost, plan)
    assert None not in costs, case
    assert sum(costs) == brute_force_cost(lengths, budget, cap, multiple, compile_cost), case
    flat = [lengths[i] for g in plan for i in g]
    assert flat == sorted(flat, reverse=True)


def test_plan_without_budget_and_over_budget_rows():
    lengths = [3, 9, 9, 1, 12]
    assert plan_micro_batches(lengths, 0) == [[4, 1, 2, 0, 3]]  # one call, longest first, ties by index
    assert plan_micro_batches(lengths, 0, max_rows=2) == [[4, 1], [2, 0], [3]]
    # a 5000-token row (bucket 6144) over a 1024 budget runs alone; the short rows share one call
    assert plan_micro_batches([10, 5000, 12, 9], 1024) == [[1], [2, 0, 3]]
    # with fsdp=2 the smallest row bucket is 2 rows: two long rows cost no more together than alone
    assert plan_micro_batches([5000, 5000, 4000], 1024, multiple=2) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="token_budget=-1"):
        plan_micro_batches([1], -1)


def test_plan_reuses_compiled_shapes():
    """Six rows (four of 128 tokens): with padding and calls as the only costs they split [4, 128] +
    [2, 64] (1,152 instead of 1,280); when a new shape costs a compile, an [8, 128] program already
    compiled is reused, and a first round does not split to save 128 tokens."""
    lengths = [128, 60, 128, 50, 128, 128]
    assert plan_micro_batches(lengths, 16384) == [[0, 2, 4, 5], [1, 3]]
    assert plan_micro_batches(lengths, 16384, known_shapes={(8, 128)}, new_shape_cost=16384) == [[0, 2, 4, 5, 1, 3]]
    assert [len(g) for g in plan_micro_batches(lengths, 16384, new_shape_cost=16384)] == [6]
    # the issue's split is worth a compile: 2,048 padded tokens instead of 65,536
    issue = [1000] + [10] * 63
    assert [len(g) for g in plan_micro_batches(issue, 16384, known_shapes={(64, 1024)}, new_shape_cost=16384)] == [1, 63]


def test_plan_of_many_rounds_uses_few_shapes_and_is_fast():
    """1000 random rounds of 1-300 rows of 1-2000 tokens under a 16k budget: every call within the
    budget, and every shape one of the 109 (power-of-two rows, length bucket <= 2048) pairs that fit it,
    whatever the rounds (unbucketed, these rounds would have hundreds of thousands of possible shapes)."""
    import time

    lengths_b = {length_bucket(n) for n in range(1, 2001)}
    allowed = {(rows, seq) for seq in lengths_b for rows in (2**p for p in range(15)) if rows * seq <= 16384}
    assert len(allowed) == 109
    rng = np.random.default_rng(0)
    shapes, start = set(), time.perf_counter()
    for _ in range(1000):
        lengths = [int(x) for x in rng.integers(1, 2001, int(rng.integers(1, 301)))]
        plan = plan_micro_batches(lengths, 16384)
        assert sorted(i for g in plan for i in g) == list(range(len(lengths)))
        shapes |= {(row_bucket(len(g), 1, 0), length_bucket(max(lengths[i] for i in g))) for g in plan}
    assert time.perf_counter() - start < 20
    assert shapes <= allowed, sorted(shapes - allowed)


# ---- the backend ----


def record_shapes(backend):
    """(first call of the round?, [rows, tokens]) of every jit call of forward_backward: the first call of
    a round runs the "grads" program, later ones "accumulate" (each compiles once per shape)."""
    shapes, real_run = [], backend.runtime.run

    def run(name, fn, *args):
        shapes.append((len(args) == 3, tuple(args[-1]["input_ids"].shape)))
        return real_run(name, fn, *args)

    backend.runtime.run = run
    return shapes


def mixed_round(seed, long, short_lengths):
    """One long datum and short ones from two adapters and three requests, with two losses."""
    short, third = random_datums(seed + 1, short_lengths), len(short_lengths) // 3
    return make_batch([
        ce_request("r1", "a", random_datums(seed, [long]) + short[:third]),
        ("r2", "b", random_datums(seed + 2, short_lengths[third:2 * third], advantages=lambda rng, n: rng.normal(
            size=n).tolist(), logprobs=lambda rng, n: (-rng.random(n)).tolist()), "importance_sampling", None),
        ce_request("r3", "a", short[2 * third:]),
    ])


def assert_same_outputs(got, want):
    for request_id, w in want.items():
        g = got[request_id]
        assert isinstance(g, types.ForwardBackwardOutput) and isinstance(w, types.ForwardBackwardOutput)
        assert abs(g.metrics["loss:sum"] - w.metrics["loss:sum"]) <= 1e-5 * abs(w.metrics["loss:sum"])
        for x, y in zip(g.loss_fn_outputs, w.loss_fn_outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                np.testing.assert_allclose(x[key].to_numpy(), y[key].to_numpy(), rtol=1e-5, atol=1e-6)


def test_micro_batches_pad_little_equal_one_big_batch_and_compile_few_shapes(tiny_dirs):
    """1. The issue's round (one 1,000-token datum and 63 ten-token datums, two adapters, three requests)
    under the default 16k budget runs as [1, 1024] + [64, 16]: 2,048 padded tokens for 1,630 real (<= 1.5x;
    one call would be [64, 1024], 40x), counted in the backend's metrics.
    2. A 1,000-token datum and 7 short ones of mixed lengths under a 64-token budget: the long row is over
    the budget and runs alone, the others in calls of <= 64 tokens; log-probs, losses, gradient sums and
    counters equal those of the one big call (budget 0, [8, 1024]) to 1e-5 relative.
    3. Rounds of other lengths in the same buckets compile nothing new: 4 programs in all."""
    backend = new_backend(tiny_dirs, max_seq_len=1024)
    assert backend.config.train_micro_batch_tokens == 16384  # the default
    shapes = record_shapes(backend)

    def run(batch, budget):
        for model_id in ("a", "b"):  # start from zero sums and counters
            backend._reset_accumulation(model_id, grads=True)
        backend.config.train_micro_batch_tokens = budget
        shapes.clear()
        real = backend.metrics.tokens_real.get("forward_backward", 0)
        padded = backend.metrics.tokens_padded.get("forward_backward", 0)
        out = backend.forward_backward(batch)
        assert all(isinstance(o, types.ForwardBackwardOutput) for o in out.values()), out
        return {"out": out, "grads": {m: backend.grad_sum_of(m) for m in ("a", "b")},
                "counters": {m: dict(backend._accumulated[m]) for m in ("a", "b")}, "shapes": list(shapes),
                "real": backend.metrics.tokens_real["forward_backward"] - real,
                "padded": backend.metrics.tokens_padded["forward_backward"] - padded}

    issue = run(mixed_round(30, 1000, [10] * 63), 16384)
    assert issue["shapes"] == [(True, (1, 1024)), (False, (64, 16))]
    assert issue["real"] == 1000 + 63 * 10 and issue["padded"] == 1024 + 64 * 16 <= 1.5 * issue["real"]
    assert issue["counters"]["a"] == {"sequences": 1 + 42, "tokens": 1000 + 42 * 10}

    batch = mixed_round(40, 1000, [3, 9, 16, 11, 5, 14, 8])
    big, small = run(batch, 0), run(batch, 64)
    assert big["shapes"] == [(True, (8, 1024))] and big["padded"] == 8 * 1024
    assert small["shapes"] == [(True, (1, 1024)), (False, (4, 16)), (False, (4, 16))]
    assert small["padded"] == 1024 + 2 * 64 and small["real"] == big["real"] == 1000 + 66
    assert_same_outputs(small["out"], big["out"])
    for model_id in ("a", "b"):
        _assert_close_trees(big["grads"][model_id], small["grads"][model_id])
    assert small["counters"] == big["counters"]
    assert backend.metrics.compiles == {"forward_backward": 4}  # one per (program, shape) above

    rng = np.random.default_rng(3)
    for seed in (50, 60):
        other = run(mixed_round(seed, int(rng.integers(769, 1025)), [int(x) for x in rng.integers(1, 17, 63)]), 16384)
        assert [shape for _, shape in other["shapes"]] == [(1, 1024), (64, 16)]
    assert backend.metrics.compiles == {"forward_backward": 4}
