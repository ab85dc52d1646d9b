"""The engine's request and call records (tx/engine/telemetry.py) with hand-made ops and times: what a trace,
a session's stats and Prometheus read."""

from __future__ import annotations

import pytest

from tx import types
from tx.engine import paths
from tx.engine.ops import Op, SampleRequest
from tx.engine.telemetry import LATENCY_BUCKETS, QUEUE_SAMPLE_S, Telemetry, session_of


def fb(request_id: str, session: str = "s1", size: int = 2, tokens: int = 16) -> Op:
    return Op(request_id, "forward_backward", None, model_id=paths.model_id_of(session, 0), size=size, tokens=tokens,
              owner="tenant-a")


def sample(request_id: str, session: str | None = "s1", prompt: int = 3, n: int = 2) -> Op:
    payload = SampleRequest(list(range(prompt)), types.SamplingParams(max_tokens=4), n, False, 0, "")
    return Op(request_id, "sample", payload, session_id=session, size=n, owner="tenant-a")


def bucket(seconds: float) -> int:
    return next(i for i, bound in enumerate((*LATENCY_BUCKETS, float("inf"))) if seconds <= bound)


def test_a_pass_from_accepted_to_finished():
    t = Telemetry()
    op = fb("r1")
    t.accepted(op, now=10.0)
    t.started([op], 11.0)
    t.call_of("forward_backward", "tiny", 11.0, 13.5, [op], ok=True)
    t.finished([("r1", "done")], now=14.0)
    (record,), (call,), queue = t.snapshot(session_id="s1")
    assert (record.kind, record.session_id, record.model_id, record.owner) == ("forward_backward", "s1", "s1:train:0",
                                                                               "tenant-a")
    assert (record.accepted, record.started, record.finished, record.status) == (10.0, 11.0, 14.0, "done")
    assert (record.size, record.tokens_in) == (2, 16)
    assert (call.kind, call.start, call.end, call.rows, call.tokens, call.shares) == (
        "forward_backward", 11.0, 13.5, 2, 16, (("s1", 2, 16),))
    assert queue == []  # queue samples are server-wide only
    finished, latency, waited, tokens = t.counters()
    assert finished == {("forward_backward", "done"): 1}
    assert latency["forward_backward"].total == 4.0 and latency["forward_backward"].counts[bucket(4.0)] == 1
    assert sum(latency["forward_backward"].counts) == 1
    assert waited["forward_backward"].counts[bucket(1.0)] == 1 and waited["forward_backward"].total == 1.0
    assert tokens["trained"] == 16 and tokens["forward"] == tokens["sampled"] == 0
    assert t.open_requests() == 0
    assert t.snapshot(session_id="s2") == ([], [], [])


def test_sampling_requests_count_their_sequences_in_flight_and_tokens():
    t = Telemetry()
    mine, theirs, loose = sample("a", "s1"), sample("b", "s2", n=3), sample("c", None, n=1)
    for op in (mine, theirs, loose):
        t.accepted(op, "tiny", now=1.0)
    assert t.snapshot(session_id="s1")[0][0].tokens_in == 3 * 2  # prompt tokens times samples
    t.started([mine, theirs, loose], 2.0)
    assert t.sampling_shares("tiny") == {"s1": (2, 0), "s2": (3, 0), "": (1, 0)}
    assert t.sampling_shares("other") == {}
    t.produced("a", 8)
    t.finished([("a", "done")], now=3.0)
    assert t.sampling_shares("tiny") == {"s2": (3, 0), "": (1, 0)}
    t.finished([("b", "failed"), ("c", "done")], now=4.0)
    assert t.sampling_shares("tiny") == {}
    finished, _, _, tokens = t.counters()
    assert finished == {("sample", "done"): 2, ("sample", "failed"): 1}
    assert tokens["sampled"] == 8 and tokens["prompt"] == 6 + 3  # the failed request counts nothing


def test_a_request_refused_before_it_ran_waited_its_whole_latency():
    t = Telemetry()
    t.accepted(fb("r1"), now=5.0)
    t.finished([("r1", "failed"), ("never-accepted", "done")], now=7.0)
    (record,), _, _ = t.snapshot()
    assert record.started == record.finished == 7.0 and record.status == "failed"
    finished, latency, waited, tokens = t.counters()
    assert finished == {("forward_backward", "failed"): 1} and tokens["trained"] == 0
    assert waited["forward_backward"].total == latency["forward_backward"].total == 2.0


def test_the_ring_is_bounded_but_keeps_open_requests():
    t = Telemetry(max_requests=2, max_calls=2)
    ops = [fb(f"r{i}") for i in range(3)]
    for i, op in enumerate(ops):
        t.accepted(op, now=float(i))
    assert [r.request_id for r in t.snapshot()[0]] == ["r0", "r1", "r2"]  # r0 left the ring but is still open
    t.finished([(op.request_id, "done") for op in ops], now=10.0)
    assert [r.request_id for r in t.snapshot()[0]] == ["r1", "r2"]
    for i in range(3):
        t.call("optim_step", "tiny", float(i), i + 0.5, 1, 0, True, {"s1": (1, 0)})
    assert [c.start for c in t.snapshot()[1]] == [1.0, 2.0]
    finished, _, _, _ = t.counters()
    assert finished == {("forward_backward", "done"): 3}  # the counters never drop


def test_a_busy_session_does_not_drop_another_sessions_calls():
    """Each session keeps its own bounded call ring: s2 filling the server-wide ring leaves s1's calls; the
    least recently called session's ring goes first when there are too many."""
    t = Telemetry(max_calls=4, max_session_calls=3, max_call_sessions=2)
    for i in range(2):
        t.call("forward_backward", "tiny", float(i), i + 0.5, 2, 16, True, {"s1": (2, 16)})
    for i in range(2, 12):
        t.call("forward_backward", "tiny", float(i), i + 0.5, 2, 16, True, {"s2": (1, 8), "": (1, 8)})
    assert [c.start for c in t.snapshot(session_id="s1")[1]] == [0.0, 1.0]
    assert [c.start for c in t.snapshot(session_id="s2")[1]] == [9.0, 10.0, 11.0]  # its own bound
    assert [c.start for c in t.snapshot()[1]] == [8.0, 9.0, 10.0, 11.0]  # the server-wide ring
    assert [c.start for c in t.snapshot(5.0, session_id="s1")[1]] == []  # `since` still applies
    t.call("optim_step", "tiny", 12.0, 12.5, 1, 0, True, {"s3": (1, 0)})  # s1 is the least recently called
    assert t.snapshot(session_id="s1")[1] == [] and len(t.snapshot(session_id="s2")[1]) == 3


def test_snapshot_since_keeps_what_ended_later_and_what_is_open():
    t = Telemetry()
    early, late, still = fb("early"), fb("late"), fb("open")
    for op in (early, late, still):
        t.accepted(op, now=1.0)
    t.finished([("early", "done")], now=2.0)
    t.finished([("late", "done")], now=20.0)
    t.call("forward_backward", "tiny", 1.0, 2.0, 2, 16, True, {"s1": (2, 16)})
    t.call("forward_backward", "tiny", 15.0, 19.0, 2, 16, True, {"s1": (2, 16)})
    requests, calls, _ = t.snapshot(since=10.0)
    assert [r.request_id for r in requests] == ["late", "open"] and [c.start for c in calls] == [15.0]


def test_queue_samples_are_kept_on_change_or_once_a_second():
    t = Telemetry()
    t.queue_sample(1.0, 2, 0, 0, 1, 4)
    t.queue_sample(1.2, 2, 0, 0, 1, 4)  # unchanged within a second: dropped
    t.queue_sample(1.3, 3, 0, 0, 1, 4)
    t.queue_sample(1.8 + QUEUE_SAMPLE_S, 3, 0, 0, 1, 4)
    queue = t.snapshot()[2]
    assert [(q.t, q.training) for q in queue] == [(1.0, 2), (1.3, 3), (1.8 + QUEUE_SAMPLE_S, 3)]
    assert queue[0].sampling_sequences == 4


@pytest.mark.parametrize("op, session", [(fb("r", "sess-1"), "sess-1"), (sample("s", "sess-2"), "sess-2"),
                                         (Op("x", "optim_step", None), None)])
def test_the_session_of_a_request(op, session):
    assert session_of(op) == session


def test_session_of_model_ids():
    assert paths.session_of("sess-abc:train:3") == "sess-abc"
    assert paths.session_of("not-a-model") is None
