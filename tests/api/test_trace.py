"""GET /api/v1/sessions/{id}/trace (Chrome JSON trace events, for Perfetto) and /stats (time series): after a
known sequence of requests the session's spans are those requests, in order, each nested and well formed; the
backend calls carry the session's rows and tokens; another tenant gets the 404 of an unknown session."""

from __future__ import annotations

import json
import time

import pytest

import tx
from tests.api.telemetry_app import (
    ADMIN,
    KEY,
    LENGTH,
    MAX_TOKENS,
    OTHER,
    PROMPT,
    ROWS,
    SAMPLES,
    app_client,
    headers,
    run_session,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    return tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_lora_adapters=4, max_lora_rank=4, max_seq_len=32))


@pytest.fixture(scope="module")
def sessions(backend, tmp_path_factory):
    """Tenant KEY's session (2 forward_backward, 1 optim_step, 1 sample) and, after it, tenant OTHER's (1, 1, 0)."""
    with app_client(tmp_path_factory.mktemp("trace"), backend) as client:
        mine, sent = run_session(client)
        theirs, their_sent = run_session(client, 1, 1, 0, key=OTHER, seed=1)
        client.mine, client.sent, client.theirs, client.their_sent = mine, sent, theirs, their_sent
        yield client


def trace(client, session: str, key: str = KEY) -> dict:
    """The session's trace once every request in it shows finished (the record is written as the future is)."""
    deadline = time.monotonic() + 10
    while True:
        r = client.get(f"/api/v1/sessions/{session}/trace", headers=headers(key))
        assert r.status_code == 200, r.text
        assert r.headers["content-disposition"] == f'attachment; filename="tx-{session}.trace.json"'
        body = json.loads(r.content)
        spans = [e for e in body["traceEvents"] if e.get("cat") == "request"]
        if all(e["args"]["status"] != "pending" for e in spans) or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def by_cat(body: dict, cat: str) -> list[dict]:
    return sorted((e for e in body["traceEvents"] if e.get("cat") == cat), key=lambda e: e["ts"])


def test_request_spans_are_the_requests_sent_in_order(sessions):
    body = trace(sessions, sessions.mine)
    spans = by_cat(body, "request")
    assert [(e["name"], e["args"]["request_id"]) for e in spans] == sessions.sent
    assert {e["args"]["status"] for e in spans} == {"done"}
    assert {e["args"]["session_id"] for e in spans} == {sessions.mine}
    running = {e["args"]["request_id"]: e for e in by_cat(body, "running")}
    assert len(running) == len(spans)
    for span in spans:
        assert span["ph"] == "X" and span["ts"] >= 0 and span["dur"] >= 0, span
        inner = running[span["args"]["request_id"]]
        assert inner["pid"] == span["pid"] and inner["tid"] == span["tid"]  # on the same lane: nested
        assert span["ts"] <= inner["ts"] and inner["dur"] >= 0
        assert inner["ts"] + inner["dur"] <= span["ts"] + span["dur"] + 0.2  # same end (rounded to 0.1 us)
        assert abs(span["args"]["total_s"] * 1e6 - span["dur"]) < 2
    # requests of one lane do not overlap (Perfetto nests X events per thread)
    lanes: dict[int, float] = {}
    for span in spans:
        assert span["ts"] >= lanes.get(span["tid"], -1.0), span
        lanes[span["tid"]] = span["ts"] + span["dur"]
    fb = [e for e in spans if e["name"] == "forward_backward"]
    assert [e["args"]["tokens_in"] for e in fb] == [ROWS * LENGTH] * 2 and [e["args"]["size"] for e in fb] == [ROWS] * 2
    (sample,) = [e for e in spans if e["name"] == "sample"]
    assert sample["args"]["tokens_out"] == SAMPLES * MAX_TOKENS
    assert sample["args"]["tokens_in"] == SAMPLES * len(PROMPT)
    assert body["otherData"]["session_id"] == sessions.mine and body["otherData"]["requests"] == len(sessions.sent)


def test_backend_calls_carry_the_sessions_rows(sessions):
    body = trace(sessions, sessions.mine)
    calls = by_cat(body, "backend")
    kinds = {e["name"] for e in calls}
    assert {"create_model", "forward_backward", "optim_step", "sample_submit", "sample_step"} <= kinds, kinds
    fb = [e for e in calls if e["name"] == "forward_backward"]
    assert sum(e["args"]["rows"] for e in fb) == 2 * ROWS and sum(e["args"]["tokens"] for e in fb) == 2 * ROWS * LENGTH
    assert [e["args"]["rows"] for e in calls if e["name"] == "sample_submit"] == [SAMPLES]
    steps = [e for e in calls if e["name"] == "sample_step"]
    assert all(e["args"]["rows"] == SAMPLES for e in steps)
    assert sum(e["args"]["tokens"] for e in steps) >= SAMPLES * MAX_TOKENS  # decoded (and prefilled) alone
    assert len([e for e in calls if e["name"] == "optim_step"]) == 1
    assert all(e["dur"] >= 0 and e["args"]["ok"] for e in calls)
    assert "call_rows" not in fb[0]["args"]  # a tenant sees its own share of a call, not the call's total
    # each request's backend work starts with a call of its kind
    starts = {(e["name"], e["ts"]) for e in calls}
    for span in by_cat(body, "running"):
        kind = span["name"].removesuffix(" running")
        assert (("sample_submit" if kind == "sample" else kind), span["ts"]) in starts, span
    # none of the other tenant's calls: its model's forward_backward ran after this session's requests
    last_end = max(e["ts"] + e["dur"] for e in by_cat(body, "request"))
    assert all(e["ts"] <= last_end for e in calls)


def test_counters_end_with_nothing_queued_or_running(sessions):
    body = trace(sessions, sessions.mine)
    counters = [e for e in body["traceEvents"] if e["ph"] == "C" and e["name"] == "requests"]
    assert counters and counters[-1]["args"] == {"queued": 0, "running": 0}
    assert max(e["args"]["queued"] + e["args"]["running"] for e in counters) >= 2  # pipelined: fb 2 sent as 1 runs
    tokens = [e for e in body["traceEvents"] if e["ph"] == "C" and e["name"] == "tokens/s"]
    assert tokens and set(tokens[0]["args"]) == {"training", "sampling", "prefill"}
    step_s = (tokens[1]["ts"] - tokens[0]["ts"]) / 1e6
    assert sum(e["args"]["training"] for e in tokens) * step_s == pytest.approx(2 * ROWS * LENGTH, rel=1e-3)


def test_another_tenant_cannot_read_the_trace(sessions):
    for route in ("trace", "stats"):
        stranger = sessions.get(f"/api/v1/sessions/{sessions.mine}/{route}", headers=headers(OTHER))
        unknown = sessions.get(f"/api/v1/sessions/no-such-session/{route}", headers=headers(OTHER))
        assert stranger.status_code == unknown.status_code == 404
        assert stranger.json()["detail"] == unknown.json()["detail"].replace("no-such-session", sessions.mine)
    assert sessions.get(f"/api/v1/sessions/{sessions.mine}/trace", headers={"X-API-Key": ""}).status_code == 401
    # the other tenant's own trace has only its requests
    theirs = trace(sessions, sessions.theirs, OTHER)
    assert [(e["name"], e["args"]["request_id"]) for e in by_cat(theirs, "request")] == sessions.their_sent


def test_admin_reads_every_session_and_the_server_trace(sessions):
    body = trace(sessions, sessions.mine, ADMIN)
    assert [e["args"]["request_id"] for e in by_cat(body, "request")] == [rid for _, rid in sessions.sent]
    fb = [e for e in by_cat(body, "backend") if e["name"] == "forward_backward"]
    assert all(e["args"]["call_rows"] >= e["args"]["rows"] for e in fb)
    assert sessions.get("/api/v1/trace", headers=headers(KEY)).status_code == 403
    server = sessions.get("/api/v1/trace?window_s=3600", headers=headers(ADMIN))
    assert server.status_code == 200
    ids = [e["args"]["request_id"] for e in by_cat(json.loads(server.content), "request")]
    assert ids == [rid for _, rid in sessions.sent + sessions.their_sent]
    assert any(e["name"] == "engine queue" for e in json.loads(server.content)["traceEvents"])
    assert sessions.get("/api/v1/stats", headers=headers(KEY)).status_code == 403
    stats = sessions.get("/api/v1/stats?window_s=3600", headers=headers(ADMIN)).json()
    assert stats["requests"]["forward_backward"]["done"] == 3 and stats["requests"]["optim_step"]["done"] == 2


def test_session_stats(sessions):
    r = sessions.get(f"/api/v1/sessions/{sessions.mine}/stats?window_s=300&step_s=0.5")
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["step_s"] == 0.5 and len(stats["t"]) == 600
    series = stats["series"]
    assert {len(v) for v in series.values()} == {600}
    assert sum(series["training_tokens_per_s"]) * 0.5 == pytest.approx(2 * ROWS * LENGTH)
    assert sum(series["sampling_tokens_per_s"]) * 0.5 == pytest.approx(SAMPLES * MAX_TOKENS)
    assert sum(series["prefill_tokens_per_s"]) * 0.5 == pytest.approx(SAMPLES * len(PROMPT))
    assert all(0 <= u <= 1 for u in series["training_utilization"]) and max(series["training_utilization"]) > 0
    assert series["active_sample_requests"][-1] == 0 and series["queued_requests"][-1] == 0
    assert stats["requests"] == {"create_model": {"done": 1, "failed": 0, "pending": 0},
                                 "forward_backward": {"done": 2, "failed": 0, "pending": 0},
                                 "optim_step": {"done": 1, "failed": 0, "pending": 0},
                                 "sample": {"done": 1, "failed": 0, "pending": 0}}
    fb = stats["latency_s"]["forward_backward"]
    assert fb["count"] == 2 and 0 < fb["p50"] <= fb["p90"] <= fb["p99"]
    assert stats["latency_s"]["sample"]["count"] == 1
    for bad in ("window_s=0", "window_s=-1", "window_s=60&step_s=120"):
        assert sessions.get(f"/api/v1/sessions/{sessions.mine}/stats?{bad}").status_code == 400, bad


def test_after_a_restart_the_session_series_and_the_loss_history_come_from_the_store(backend, tmp_path):
    """A new server on the same store has empty rings; the session's requests (spans, tokens, latencies) and
    its run's loss curve are what the store kept. Backend calls are not stored: none after the restart."""
    def read(client, session: str) -> tuple[dict, dict, list[tuple[str, str]]]:
        history = client.get(f"/api/v1/training_runs/{session}:train:0/loss_history")
        stats = client.get(f"/api/v1/sessions/{session}/stats?window_s=600&step_s=1")
        assert history.status_code == stats.status_code == 200, (history.text, stats.text)
        spans = by_cat(trace(client, session), "request")
        return history.json(), stats.json(), [(e["name"], e["args"]["request_id"]) for e in spans]

    with app_client(tmp_path, backend) as client:
        session, sent = run_session(client, forward_backward=3, optim_step=2)
        history, stats, spans = read(client, session)
    assert [s["step"] for s in history["steps"]] == [1, 2] and history["pending"] is None
    assert history["steps"][0]["passes"] == 3 and history["steps"][0]["tokens"] == 3 * ROWS * LENGTH
    with app_client(tmp_path, backend) as client:  # the restarted server
        assert client.engine.loss_history.of(f"{session}:train:0") == ([], None)
        again, stats_again, spans_again = read(client, session)
    assert again == history  # every step: loss, tokens, passes, metrics and time
    assert spans_again == spans == [(kind, rid) for kind, rid in sent]
    assert stats_again["requests"] == stats["requests"]
    assert {k: v["count"] for k, v in stats_again["latency_s"].items()} == \
        {k: v["count"] for k, v in stats["latency_s"].items()}
    for series in ("training_tokens_per_s", "sampling_tokens_per_s", "prefill_tokens_per_s"):
        assert sum(stats_again["series"][series]) == pytest.approx(sum(stats["series"][series])), series
    assert sum(stats_again["series"]["training_tokens_per_s"]) == pytest.approx(3 * ROWS * LENGTH)
    assert max(stats["series"]["training_utilization"]) > 0 == max(stats_again["series"]["training_utilization"])
