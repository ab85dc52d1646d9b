"""A session's (or the server's) timeline from the engine's records (`tx/engine/telemetry.py`): as Chrome JSON
trace events, the format Perfetto's UI (ui.perfetto.dev) and chrome://tracing open, and as time series a
console can plot.

The trace has three tracks: "requests" (one "X" event per request from accepted to finished, with a nested
"running" event from the start of its backend call to finished; requests that overlap in time go on separate
lanes so that every lane nests), "backend calls" (one "X" event per call that ran the session's requests,
with the session's rows and tokens) and counters ("C" events: the session's queued and running requests at
each change, and its tokens per second).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from tx.engine.telemetry import TRAINING_CALLS, CallRecord, QueueSample, RequestRecord

REQUESTS_PID, CALLS_PID = 1, 2
MAX_POINTS = 1000  # time-series points (buckets) at most


def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 1)


def _lanes(requests: list[RequestRecord], now: float) -> list[int]:
    """A lane per request (sorted by accepted) such that the requests of one lane do not overlap."""
    free: list[tuple[float, int]] = []  # (end, lane) of the lanes in use
    lanes, count = [], 0
    for r in requests:
        if free and free[0][0] <= r.accepted:
            _, lane = heapq.heappop(free)
        else:
            lane, count = count, count + 1
        lanes.append(lane)
        heapq.heappush(free, (r.finished if r.finished is not None else now, lane))
    return lanes


def chrome_trace(requests: list[RequestRecord], calls: list[CallRecord], queue: list[QueueSample], now: float,
                 session_id: str | None, totals: bool) -> dict:
    """The Chrome trace of `requests` (sorted by accepted) and `calls`; `session_id` None: the whole server
    (then the calls' rows are their totals and `queue` adds the engine's queue depth). `totals`: also show
    each call's total rows and tokens (admins)."""
    starts = [r.accepted for r in requests] + [c.start for c in calls] + [q.t for q in queue]
    origin = min(starts, default=now)
    events: list[dict] = [
        {"ph": "M", "pid": REQUESTS_PID, "name": "process_name", "args": {"name": "requests"}},
        {"ph": "M", "pid": REQUESTS_PID, "name": "process_sort_index", "args": {"sort_index": 0}},
        {"ph": "M", "pid": CALLS_PID, "name": "process_name", "args": {"name": "backend calls"}},
        {"ph": "M", "pid": CALLS_PID, "name": "process_sort_index", "args": {"sort_index": 1}},
        {"ph": "M", "pid": CALLS_PID, "tid": 1, "name": "thread_name", "args": {"name": "engine thread"}},
    ]
    lanes = _lanes(requests, now)
    for lane in range(max(lanes, default=-1) + 1):
        events.append({"ph": "M", "pid": REQUESTS_PID, "tid": lane + 1, "name": "thread_name",
                       "args": {"name": f"lane {lane + 1}"}})
    for r, lane in zip(requests, lanes):
        end = r.finished if r.finished is not None else now
        args = {"request_id": r.request_id, "session_id": r.session_id, "model_id": r.model_id,
                "tenant": (r.owner or "")[:12], "status": r.status or "pending", "size": r.size,
                "tokens_in": r.tokens_in, "tokens_out": r.tokens_out,
                "queued_s": round((r.started if r.started is not None else end) - r.accepted, 6),
                "total_s": round(end - r.accepted, 6)}
        events.append({"ph": "X", "cat": "request", "name": r.kind, "pid": REQUESTS_PID, "tid": lane + 1,
                       "ts": _us(r.accepted, origin), "dur": _us(end, r.accepted), "args": args})
        if r.started is not None:
            events.append({"ph": "X", "cat": "running", "name": f"{r.kind} running", "pid": REQUESTS_PID,
                           "tid": lane + 1, "ts": _us(r.started, origin), "dur": _us(end, r.started),
                           "args": {"request_id": r.request_id}})
    for c in calls:
        rows, tokens = c.rows, c.tokens
        if session_id is not None:
            rows = sum(n for s, n, _ in c.shares if s == session_id)
            tokens = sum(t for s, _, t in c.shares if s == session_id)
        args = {"base_model": c.base_model, "ok": c.ok, "rows": rows, "tokens": tokens}
        if totals and session_id is not None:
            args.update(call_rows=c.rows, call_tokens=c.tokens, call_sessions=len(c.shares))
        events.append({"ph": "X", "cat": "backend", "name": c.kind, "pid": CALLS_PID, "tid": 1,
                       "ts": _us(c.start, origin), "dur": _us(c.end, c.start), "args": args})
    events += _request_counters(requests, origin)
    events += _token_counters(requests, origin, now)
    for q in queue:
        events.append({"ph": "C", "name": "engine queue", "pid": CALLS_PID, "ts": _us(q.t, origin),
                       "args": {"training": q.training, "samples": q.samples, "sampling": q.sampling}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "origin_unix_s": origin, "generated_unix_s": now,
                          "requests": len(requests), "backend_calls": len(calls)}}


def _request_counters(requests: list[RequestRecord], origin: float) -> list[dict]:
    """"C" events of the requests queued (accepted, not started) and running (started, not finished)."""
    changes: list[tuple[float, int, int]] = []
    for r in requests:
        changes.append((r.accepted, 1, 0))
        if r.started is not None:
            changes.append((r.started, -1, 1))
            if r.finished is not None:
                changes.append((r.finished, 0, -1))
    changes.sort(key=lambda c: c[0])
    events, queued, running = [], 0, 0
    for i, (t, dq, dr) in enumerate(changes):
        queued, running = queued + dq, running + dr
        if i + 1 == len(changes) or changes[i + 1][0] != t:  # one event per instant
            events.append({"ph": "C", "name": "requests", "pid": REQUESTS_PID, "ts": _us(t, origin),
                           "args": {"queued": queued, "running": running}})
    return events


def _token_counters(requests: list[RequestRecord], origin: float, now: float) -> list[dict]:
    """"C" events of tokens per second (trained, sampled, prefill), in buckets of at least a second."""
    if not requests:
        return []
    span = max(now - origin, 1e-3)
    step = max(1.0, span / MAX_POINTS)
    n = math.ceil(span / step)
    series = _token_series(requests, origin, step, n)
    events = [{"ph": "C", "name": "tokens/s", "pid": REQUESTS_PID, "ts": _us(origin + i * step, origin),
               "args": {k: round(v[i], 3) for k, v in series.items()}} for i in range(n)]
    events.append({"ph": "C", "name": "tokens/s", "pid": REQUESTS_PID, "ts": _us(origin + n * step, origin),
                   "args": {k: 0 for k in series}})
    return events


def _token_series(requests: list[RequestRecord], t0: float, step: float, n: int) -> dict[str, np.ndarray]:
    """Tokens per second in `n` buckets of `step` seconds from `t0`: trained (forward_backward input, at its
    finish), sampled (generated, at the finish), prefill (prompts times samples, at the start)."""
    edges = t0 + step * np.arange(n + 1)

    def rate(pairs: list[tuple[float, int]]) -> np.ndarray:
        if not pairs:
            return np.zeros(n)
        t, w = np.asarray(pairs, np.float64).T
        return np.histogram(t, bins=edges, weights=w)[0] / step

    done = [r for r in requests if r.status == "done" and r.finished is not None]
    return {"training": rate([(r.finished, r.tokens_in) for r in done if r.kind == "forward_backward"]),
            "sampling": rate([(r.finished, r.tokens_out) for r in done if r.kind == "sample"]),
            "prefill": rate([(r.started, r.tokens_in) for r in requests
                             if r.kind == "sample" and r.started is not None and r.status != "failed"])}


def _active(starts: list[float], ends: list[float], at: np.ndarray) -> np.ndarray:
    """How many intervals [start, end) contain each time in `at` (every start <= its end)."""
    s, e = np.sort(np.asarray(starts, np.float64)), np.sort(np.asarray(ends, np.float64))
    return np.searchsorted(s, at, side="right") - np.searchsorted(e, at, side="right")


def stats(requests: list[RequestRecord], calls: list[CallRecord], now: float, window_s: float,
          step_s: float | None, session_id: str | None) -> dict:
    """Time series over the last `window_s` seconds in steps of `step_s` (each value is the state at the
    end of its step, or the rate over it) and latency percentiles per request kind."""
    step = step_s or max(1.0, window_s / 60)
    n = min(MAX_POINTS, max(1, math.ceil(window_s / step)))
    t0 = now - n * step
    ends = t0 + step * np.arange(1, n + 1)
    inf = math.inf
    samples = [r for r in requests if r.kind == "sample" and r.started is not None]
    active = _active([r.started for r in samples], [r.finished if r.finished is not None else inf
                                                    for r in samples], ends)
    queued = _active([r.accepted for r in requests],
                     [r.started if r.started is not None else inf for r in requests], ends)
    busy = np.zeros(n)
    for c in calls:
        if c.kind not in TRAINING_CALLS or c.end <= t0:
            continue
        first, last = int((max(c.start, t0) - t0) // step), min(n - 1, int((c.end - t0) // step))
        for i in range(first, last + 1):
            lo = t0 + i * step
            busy[i] += max(0.0, min(c.end, lo + step) - max(c.start, lo))
    tokens = _token_series(requests, t0, step, n)
    latency, counts = {}, {}
    for r in requests:
        if r.finished is None or r.finished >= t0:
            by = counts.setdefault(r.kind, {"done": 0, "failed": 0, "pending": 0})
            by[r.status or "pending"] += 1
    for kind in sorted({r.kind for r in requests}):
        seconds = np.asarray([r.finished - r.accepted for r in requests
                              if r.kind == kind and r.finished is not None and r.finished >= t0])
        waits = np.asarray([r.started - r.accepted for r in requests
                            if r.kind == kind and r.finished is not None and r.finished >= t0])
        if len(seconds):
            p50, p90, p99 = np.percentile(seconds, [50, 90, 99])
            latency[kind] = {"count": len(seconds), "mean": float(seconds.mean()), "p50": float(p50),
                             "p90": float(p90), "p99": float(p99), "queue_p50": float(np.percentile(waits, 50))}
    return {"session_id": session_id, "now": now, "window_s": n * step, "step_s": step,
            "t": [round(float(t), 3) for t in ends],
            "series": {"active_sample_requests": active.tolist(), "queued_requests": queued.tolist(),
                       "training_utilization": np.minimum(1.0, busy / step).round(4).tolist(),
                       "training_tokens_per_s": tokens["training"].round(3).tolist(),
                       "sampling_tokens_per_s": tokens["sampling"].round(3).tolist(),
                       "prefill_tokens_per_s": tokens["prefill"].round(3).tolist()},
            "latency_s": latency, "requests": counts}
