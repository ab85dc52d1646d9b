"""The Chrome trace and the time series of tx/api/timeline.py from hand-made records, checked against values
worked out by hand."""

from __future__ import annotations

import json

import pytest

from tx.api.timeline import chrome_trace, stats
from tx.engine.telemetry import CallRecord, QueueSample, RequestRecord


def record(request_id, kind, accepted, started, finished, tokens_in=0, tokens_out=0, status="done", size=1):
    return RequestRecord(request_id, kind, "s1", "s1:train:0", "owner-hash-0123456789", "tiny", accepted, size,
                         tokens_in, started, finished, status if finished is not None else None, tokens_out)


REQUESTS = [
    record("fb", "forward_backward", 100.0, 101.0, 103.0, tokens_in=10, size=2),
    record("smp", "sample", 102.0, 102.5, 106.0, tokens_in=4, tokens_out=8, size=2),
    record("opt", "optim_step", 102.2, 103.0, 103.5),
]
CALLS = [CallRecord("forward_backward", "tiny", 101.0, 103.0, 6, 30, True, (("s1", 2, 10), ("s2", 4, 20))),
         CallRecord("optim_step", "tiny", 103.0, 103.5, 1, 0, True, (("s1", 1, 0),)),
         CallRecord("sample_step", "tiny", 102.5, 106.0, 2, 11, True, (("s1", 2, 11),))]


def test_stats_series_by_hand():
    out = stats(REQUESTS, CALLS, now=110.0, window_s=10.0, step_s=1.0, session_id="s1")
    assert out["step_s"] == 1.0 and out["window_s"] == 10.0
    assert out["t"] == [101.0 + i for i in range(10)]  # each value is the state at the end of its step
    s = out["series"]
    # the sample waits in [102, 102.5) and the optim_step in [102.2, 103): at t=102 only the sample is queued
    assert s["queued_requests"] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert s["active_sample_requests"] == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]  # runs in [102.5, 106)
    # training calls cover [101, 103) and [103, 103.5); the sample_step is not training
    assert s["training_utilization"] == [0.0, 1.0, 1.0, 0.5, 0, 0, 0, 0, 0, 0]
    assert s["training_tokens_per_s"] == [0, 0, 0, 10.0, 0, 0, 0, 0, 0, 0]  # at the finish (103)
    assert s["sampling_tokens_per_s"] == [0, 0, 0, 0, 0, 0, 8.0, 0, 0, 0]  # at the finish (106)
    assert s["prefill_tokens_per_s"] == [0, 0, 4.0, 0, 0, 0, 0, 0, 0, 0]  # at the start (102.5)
    assert out["latency_s"]["forward_backward"] == {"count": 1, "mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0,
                                                    "queue_p50": 1.0}
    assert out["latency_s"]["sample"]["p99"] == 4.0
    assert out["requests"]["optim_step"] == {"done": 1, "failed": 0, "pending": 0}


def test_stats_percentiles_and_pending():
    many = [record(f"r{i}", "forward_backward", 50.0, 50.0, 50.0 + (i + 1)) for i in range(100)]
    many.append(record("open", "forward_backward", 90.0, None, None))
    out = stats(many, [], now=200.0, window_s=200.0, step_s=None, session_id="s1")
    lat = out["latency_s"]["forward_backward"]
    assert lat["count"] == 100 and lat["p50"] == pytest.approx(50.5) and lat["p90"] == pytest.approx(90.1)
    assert lat["p99"] == pytest.approx(99.01)
    assert out["requests"]["forward_backward"] == {"done": 100, "failed": 0, "pending": 1}
    assert out["series"]["queued_requests"][-1] == 1  # the open one never started
    assert out["step_s"] == pytest.approx(200 / 60)


def test_chrome_trace_events():
    trace = json.loads(json.dumps(chrome_trace(REQUESTS, CALLS[:2], [], now=110.0, session_id="s1", totals=False)))
    events = trace["traceEvents"]
    spans = [e for e in events if e.get("cat") == "request"]
    assert [(e["name"], e["ts"], e["dur"]) for e in spans] == [
        ("forward_backward", 0.0, 3e6), ("sample", 2e6, 4e6), ("optim_step", 2.2e6, 1.3e6)]
    # three overlapping requests: three lanes, and each "running" span inside its request on the same lane
    assert [e["tid"] for e in spans] == [1, 2, 3]
    running = [e for e in events if e.get("cat") == "running"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in running] == [
        ("forward_backward running", 1, 1e6, 2e6), ("sample running", 2, 2.5e6, 3.5e6),
        ("optim_step running", 3, 3e6, 5e5)]
    assert spans[0]["args"]["queued_s"] == 1.0 and spans[0]["args"]["tenant"] == "owner-hash-0"
    calls = [e for e in events if e.get("cat") == "backend"]
    # the session's own share of the call, not the other session's rows
    assert [(e["name"], e["args"]["rows"], e["args"]["tokens"]) for e in calls] == [("forward_backward", 2, 10),
                                                                                   ("optim_step", 1, 0)]
    assert "call_rows" not in calls[0]["args"]
    counters = [(e["ts"], e["args"]) for e in events if e["ph"] == "C" and e["name"] == "requests"]
    assert counters == [(0.0, {"queued": 1, "running": 0}), (1e6, {"queued": 0, "running": 1}),
                        (2e6, {"queued": 1, "running": 1}), (2.2e6, {"queued": 2, "running": 1}),
                        (2.5e6, {"queued": 1, "running": 2}), (3e6, {"queued": 0, "running": 2}),
                        (3.5e6, {"queued": 0, "running": 1}), (6e6, {"queued": 0, "running": 0})]
    assert trace["otherData"]["origin_unix_s"] == 100.0


def test_the_admin_sees_call_totals_and_the_server_trace_the_queue():
    trace = chrome_trace(REQUESTS, CALLS[:1], [], now=110.0, session_id="s1", totals=True)
    (call,) = [e for e in trace["traceEvents"] if e.get("cat") == "backend"]
    assert call["args"] == {"base_model": "tiny", "ok": True, "rows": 2, "tokens": 10, "call_rows": 6,
                            "call_tokens": 30, "call_sessions": 2}
    server = chrome_trace(REQUESTS, CALLS[:1], [QueueSample(101.0, 3, 1, 2, 0, 0)], now=110.0, session_id=None,
                          totals=True)
    (call,) = [e for e in server["traceEvents"] if e.get("cat") == "backend"]
    assert (call["args"]["rows"], call["args"]["tokens"]) == (6, 30)
    (queue,) = [e for e in server["traceEvents"] if e["name"] == "engine queue"]
    assert queue["ts"] == 1e6 and queue["args"] == {"training": 3, "samples": 1, "sampling": 0}


def test_an_empty_trace():
    trace = chrome_trace([], [], [], now=5.0, session_id="s1", totals=False)
    assert all(e["ph"] == "M" for e in trace["traceEvents"]) and trace["otherData"]["requests"] == 0
