"""Scheduler: which queued ops run next, and together. Pure: `Op`s in, `Round`s out, no backend."""

from __future__ import annotations

import pytest

from tx.engine.ops import PASS_KINDS, Op
from tx.engine.scheduler import Scheduler

A, B, C = "sa:train:0", "sb:train:0", "sc:train:0"


def op(kind: str, model_id: str | None = A, seq_id: int | None = None, size: int = 1, rid: str | None = None) -> Op:
    if rid is None:
        rid = f"{kind}:{model_id}:{seq_id}" if seq_id is not None else f"{kind}:{model_id}:{size}:{id(object())}"
    return Op(rid, kind, None, model_id, seq_id, None, size)


def created(sched: Scheduler, *model_ids: str, now: float = 0.0) -> None:
    """Run each model's seq 0 (its create) so that its queue expects seq 1."""
    for m in model_ids:
        sched.add(op("create_model", m, 0))
    round_ = sched.next_round(now)
    assert sorted(o.model_id for o in round_.singles) == sorted(model_ids)
    for m in model_ids:
        assert sched.expected_seq(m) == 1


def seqs(ops: list[Op]) -> list[tuple[str, int | None]]:
    return [(o.model_id, o.seq_id) for o in ops]


def test_empty_scheduler_has_nothing():
    sched = Scheduler()
    assert not sched.pending(0.0)
    assert not sched.has_ready_passes()
    assert sched.next_round(0.0).empty()
    assert sched.expected_seq(A) is None


def test_model_waits_for_its_create():
    sched = Scheduler()
    sched.add(op("optim_step", A, 1))
    assert sched.next_round(0.0).empty()  # seq 0 (create) has not arrived
    sched.add(op("create_model", A, 0))
    assert seqs(sched.next_round(0.1).singles) == [(A, 0)]
    assert seqs(sched.next_round(0.2).singles) == [(A, 1)]


def test_out_of_order_singles_run_in_seq_order_across_rounds():
    sched = Scheduler()
    created(sched, A)
    sched.add(op("optim_step", A, 3))
    sched.add(op("save_weights", A, 2))
    assert sched.next_round(1.0).empty()  # seq 1 missing: nothing may run
    sched.add(op("load_weights", A, 1))
    order = []
    for t in (2.0, 3.0, 4.0):
        round_ = sched.next_round(t)
        assert len(round_.singles) == 1 and not any(round_.passes.values())
        order += seqs(round_.singles)
    assert order == [(A, 1), (A, 2), (A, 3)]
    assert sched.next_round(5.0).empty()
    assert not sched.pending(0.0)
    assert sched.expected_seq(A) == 4


def test_out_of_order_passes_run_in_seq_order_in_one_round():
    sched = Scheduler()
    created(sched, A)
    sched.add(op("forward_backward", A, 3))
    sched.add(op("forward_backward", A, 2))
    assert not sched.has_ready_passes()
    assert sched.next_round(1.0).empty()
    sched.add(op("forward_backward", A, 1))
    assert sched.has_ready_passes()
    round_ = sched.next_round(2.0)
    assert seqs(round_.passes["forward_backward"]) == [(A, 1), (A, 2), (A, 3)]
    assert not round_.singles and not round_.passes["forward"]


def test_pass_run_stops_at_optim_step_which_runs_alone_next():
    sched = Scheduler()
    created(sched, A)
    for seq, kind in enumerate(["forward_backward", "forward_backward", "optim_step", "forward_backward"], start=1):
        sched.add(op(kind, A, seq))

    first = sched.next_round(1.0)
    assert seqs(first.passes["forward_backward"]) == [(A, 1), (A, 2)]
    assert not first.singles

    second = sched.next_round(2.0)
    assert seqs(second.singles) == [(A, 3)] and second.singles[0].kind == "optim_step"
    assert not any(second.passes.values())

    third = sched.next_round(3.0)
    assert seqs(third.passes["forward_backward"]) == [(A, 4)]
    assert not third.singles
    assert not sched.pending(0.0)


def test_passes_of_several_models_merge_into_one_round():
    sched = Scheduler()
    created(sched, A, B, C)
    sched.add(op("forward_backward", A, 1))
    sched.add(op("forward_backward", A, 2))
    sched.add(op("forward_backward", B, 1))
    sched.add(op("optim_step", C, 1))
    round_ = sched.next_round(1.0)
    assert sorted(seqs(round_.passes["forward_backward"])) == [(A, 1), (A, 2), (B, 1)]
    # one model's passes stay in seq order within the merged list
    assert [o.seq_id for o in round_.passes["forward_backward"] if o.model_id == A] == [1, 2]
    assert seqs(round_.singles) == [(C, 1)]  # another model's single goes in the same round


def test_forward_and_forward_backward_go_to_separate_lists():
    sched = Scheduler()
    created(sched, A, B)
    sched.add(op("forward", A, 1))
    sched.add(op("forward_backward", B, 1))
    round_ = sched.next_round(1.0)
    assert set(round_.passes) == set(PASS_KINDS)
    assert seqs(round_.passes["forward"]) == [(A, 1)]
    assert seqs(round_.passes["forward_backward"]) == [(B, 1)]


def test_a_models_run_stops_where_the_pass_kind_changes():
    sched = Scheduler()
    created(sched, A)
    sched.add(op("forward_backward", A, 1))
    sched.add(op("forward", A, 2))
    sched.add(op("forward_backward", A, 3))
    r1, r2, r3 = (sched.next_round(t) for t in (1.0, 2.0, 3.0))
    assert seqs(r1.passes["forward_backward"]) == [(A, 1)] and not r1.passes["forward"]
    assert seqs(r2.passes["forward"]) == [(A, 2)] and not r2.passes["forward_backward"]
    assert seqs(r3.passes["forward_backward"]) == [(A, 3)] and not r3.passes["forward"]


def test_max_pass_datums_splits_a_run_across_rounds():
    sched = Scheduler(max_pass_datums=10)
    created(sched, A)
    for seq in (1, 2, 3):
        sched.add(op("forward_backward", A, seq, size=4))
    r1 = sched.next_round(1.0)
    assert seqs(r1.passes["forward_backward"]) == [(A, 1), (A, 2)]  # 8 datums; a third would make 12 > 10
    assert sched.has_ready_passes()
    r2 = sched.next_round(2.0)
    assert seqs(r2.passes["forward_backward"]) == [(A, 3)]
    assert not sched.pending(0.0)


def test_max_pass_datums_counts_every_model_of_the_kind():
    sched = Scheduler(max_pass_datums=10)
    created(sched, A, B)
    sched.add(op("forward_backward", A, 1, size=8))
    sched.add(op("forward_backward", B, 1, size=4))
    r1 = sched.next_round(1.0)
    assert seqs(r1.passes["forward_backward"]) == [(A, 1)]  # B's 4 would make 12 > 10
    r2 = sched.next_round(2.0)
    assert seqs(r2.passes["forward_backward"]) == [(B, 1)]


def test_an_oversized_pass_still_runs_alone():
    sched = Scheduler(max_pass_datums=10)
    created(sched, A)
    sched.add(op("forward_backward", A, 1, size=25))
    sched.add(op("forward_backward", A, 2, size=1))
    r1 = sched.next_round(1.0)
    assert seqs(r1.passes["forward_backward"]) == [(A, 1)]
    r2 = sched.next_round(2.0)
    assert seqs(r2.passes["forward_backward"]) == [(A, 2)]


def test_seq_gap_blocks_until_timeout_then_next_waiting_runs():
    sched = Scheduler(seq_gap_timeout_s=10.0)
    created(sched, A)
    sched.add(op("optim_step", A, 3))  # seq 1 and 2 never arrive
    sched.add(op("forward_backward", A, 4))
    assert sched.next_round(100.0).empty()  # the wait starts here
    assert sched.next_round(105.0).empty()
    assert sched.next_round(109.9).empty()
    assert sched.expected_seq(A) == 1
    r = sched.next_round(110.0)
    assert seqs(r.singles) == [(A, 3)]  # the gap is skipped and the next waiting op runs in the same round
    assert sched.expected_seq(A) == 4
    r = sched.next_round(110.1)
    assert seqs(r.passes["forward_backward"]) == [(A, 4)]


def test_seq_gap_wait_restarts_when_the_missing_op_arrives():
    sched = Scheduler(seq_gap_timeout_s=10.0)
    created(sched, A)
    sched.add(op("optim_step", A, 2))
    assert sched.next_round(100.0).empty()
    sched.add(op("optim_step", A, 1))  # arrives in time
    assert seqs(sched.next_round(101.0).singles) == [(A, 1)]
    assert seqs(sched.next_round(102.0).singles) == [(A, 2)]
    # a later gap is timed from when it began, not from the earlier one
    sched.add(op("optim_step", A, 4))
    assert sched.next_round(108.0).empty()
    assert sched.next_round(117.9).empty()
    assert seqs(sched.next_round(118.0).singles) == [(A, 4)]


def test_seq_gap_of_one_model_does_not_block_another():
    sched = Scheduler(seq_gap_timeout_s=10.0)
    created(sched, A, B)
    sched.add(op("forward_backward", A, 2))  # A misses seq 1
    sched.add(op("forward_backward", B, 1))
    r = sched.next_round(1.0)
    assert seqs(r.passes["forward_backward"]) == [(B, 1)]


def test_samples_are_all_taken_within_max_samples():
    sched = Scheduler(max_samples=10)
    samples = [op("sample", None, size=s, rid=f"s{i}") for i, s in enumerate([4, 4, 4, 1])]
    for s in samples:
        sched.add(s)
    r1 = sched.next_round(0.0)
    assert [o.request_id for o in r1.samples] == ["s0", "s1"]  # 8; the next 4 would make 12 > 10
    r2 = sched.next_round(0.0)
    assert [o.request_id for o in r2.samples] == ["s2", "s3"]
    assert not sched.pending(0.0)


def test_all_samples_taken_in_one_round_when_they_fit():
    sched = Scheduler(max_samples=1024)
    for i in range(50):
        sched.add(op("sample", None, size=3, rid=f"s{i}"))
    r = sched.next_round(0.0)
    assert [o.request_id for o in r.samples] == [f"s{i}" for i in range(50)]
    assert not r.singles and not any(r.passes.values())
    assert not sched.pending(0.0)


def test_an_oversized_sample_request_still_runs():
    sched = Scheduler(max_samples=10)
    sched.add(op("sample", None, size=50, rid="big"))
    sched.add(op("sample", None, size=1, rid="small"))
    assert [o.request_id for o in sched.next_round(0.0).samples] == ["big"]
    assert [o.request_id for o in sched.next_round(0.0).samples] == ["small"]


def test_samples_have_no_seq_order():
    sched = Scheduler()
    created(sched, A)
    sched.add(op("forward_backward", A, 2))  # A is blocked on seq 1...
    sched.add(op("sample", None, rid="s"))
    r = sched.next_round(1.0)
    assert [o.request_id for o in r.samples] == ["s"]  # ...but sampling is not
    assert not any(r.passes.values())


def test_control_ops_run_as_singles_in_the_next_round():
    sched = Scheduler()
    created(sched, A, B)
    sched.add(op("forward_backward", A, 1))
    unload = op("unload_model", B, None, rid="unload-B")
    sched.add(unload)
    assert sched.expected_seq(B) == 1  # unsequenced: does not touch B's order
    assert sched.pending(0.0)
    r = sched.next_round(1.0)
    assert r.singles == [unload]
    assert seqs(r.passes["forward_backward"]) == [(A, 1)]
    assert sched.next_round(2.0).empty()  # taken once


def test_control_ops_do_not_wait_for_a_seq_gap():
    sched = Scheduler(seq_gap_timeout_s=1e9)
    created(sched, A)
    sched.add(op("optim_step", A, 5))
    sched.add(op("unload_model", A, None, rid="unload-A"))
    r = sched.next_round(1.0)
    assert [o.request_id for o in r.singles] == ["unload-A"]


def test_drop_model_returns_its_queued_ops_and_forgets_it():
    sched = Scheduler()
    created(sched, A, B)
    queued = [op("forward_backward", A, 2), op("optim_step", A, 3)]
    for o in queued:
        sched.add(o)
    sched.add(op("forward_backward", B, 1))
    dropped = sched.drop_model(A)
    assert sorted(o.request_id for o in dropped) == sorted(o.request_id for o in queued)
    assert sched.expected_seq(A) is None
    assert sched.drop_model(A) == []  # unknown now
    r = sched.next_round(1.0)
    assert seqs(r.passes["forward_backward"]) == [(B, 1)]
    assert not sched.pending(0.0)


def test_drop_unknown_model_returns_nothing():
    assert Scheduler().drop_model("nope:train:0") == []


@pytest.mark.parametrize("kind", ["save_weights", "save_weights_for_sampler", "load_weights", "optim_step"])
def test_non_pass_model_ops_are_singles(kind):
    sched = Scheduler()
    created(sched, A)
    sched.add(op(kind, A, 1))
    sched.add(op("forward_backward", A, 2))
    assert not sched.has_ready_passes()
    r = sched.next_round(1.0)
    assert seqs(r.singles) == [(A, 1)] and not any(r.passes.values())
    assert sched.has_ready_passes()


def test_max_pass_tokens_splits_a_round():
    """Issue 12 #12: a round's backend call holds at most max_pass_tokens tokens (an oversized one alone)."""
    sched = Scheduler(max_pass_datums=100, max_pass_tokens=1000)
    created(sched, A, B)
    for seq, tokens in ((1, 600), (2, 300), (3, 200)):
        sched.add(Op(f"a{seq}", "forward_backward", None, A, seq, None, 1, tokens))
    sched.add(Op("b1", "forward_backward", None, B, 1, None, 1, 5000))
    rounds = [sched.next_round(float(t)).passes["forward_backward"] for t in range(1, 5)]
    assert sorted(sum(op.tokens for op in r) for r in rounds if r) == [200, 900, 5000]
    assert all(sum(op.tokens for op in r) <= 1000 or len(r) == 1 for r in rounds)
