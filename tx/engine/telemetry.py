"""What the engine did, kept in memory for traces, per-session statistics and Prometheus (read by tx/api).

The engine appends one record per accepted request (accepted / started / finished times, status, tokens),
one per backend call (kind, start, end, rows and tokens, and each session's share of its rows) and a queue
depth sample per round (at most one a second while the depth stays the same), each to a bounded ring: the
oldest records are dropped first. Next to the rings it keeps cumulative counters that never drop: requests
finished by kind and status, their latency (accepted -> finished) and queue-wait (accepted -> started)
histograms, and tokens by kind. The hot path is one small record and a few dict updates per request or call,
under a lock held for nothing else; nothing is done per token.

`LossHistory` keeps, per model, its training steps (loss:sum, tokens and metrics of the forward_backward calls
before each optim_step) for the console's loss curves.

What survives a restart is in the store: each future's span (`span_of`, written with its result) and each
training step (a `train_steps` row written with its optim_step's result); the API merges those into what it
reads from here (`tx/api/telemetry_routes.py`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tx.engine import paths
from tx.engine.ops import PASS_KINDS, Op

# upper bounds (seconds) of the latency histograms' buckets; the last bucket is +Inf
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TRAINING_CALLS = (*PASS_KINDS, "optim_step")  # backend calls that count as training time
MAX_REQUESTS = 100_000
MAX_CALLS = 100_000
MAX_QUEUE_SAMPLES = 20_000
MAX_SESSION_CALLS = 10_000  # calls kept per session besides the server-wide ring
MAX_CALL_SESSIONS = 1_000  # sessions with their own call ring (the least recently called dropped first)
MAX_STEPS = 10_000  # loss history: steps kept per model (the oldest dropped first)
MAX_HISTORIES = 10_000  # models with a loss history (the least recently trained dropped first)
QUEUE_SAMPLE_S = 1.0  # an unchanged queue depth is sampled at most this often


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    kind: str
    session_id: str | None
    model_id: str | None
    owner: str | None  # the tenant (SHA-256 of its API key)
    base_model: str | None  # sampling requests: the base model they run on
    accepted: float
    size: int  # datums (passes) or sequences (samples)
    tokens_in: int  # pass: input tokens; sample: prompt tokens times num_samples
    started: float | None = None
    finished: float | None = None
    status: str | None = None  # None while pending, then "done" | "failed"
    tokens_out: int = 0  # sample: tokens generated


@dataclass(slots=True)
class CallRecord:
    kind: str  # forward_backward, forward, optim_step, save_weights, ..., sample_submit, sample_step
    base_model: str
    start: float
    end: float
    rows: int  # datums (passes), sequences (sampling), 1 (single ops)
    tokens: int  # pass: input tokens; sample_submit: prompt tokens; sample_step: tokens prefilled + decoded
    ok: bool
    shares: tuple[tuple[str, int, int], ...]  # (session_id, rows, tokens) of each session in the call ("": none)


@dataclass(slots=True)
class QueueSample:
    t: float
    training: int  # training and other sequenced requests waiting in the scheduler
    samples: int  # sampling requests waiting to be handed to a backend
    sample_sequences: int  # their sequences
    sampling: int  # sampling requests in flight (in a backend)
    sampling_sequences: int


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def copy(self) -> Histogram:
        return Histogram(list(self.counts), self.total)


def stored_record(row: dict) -> RequestRecord:
    """A request as the store keeps it (`Store.request_spans`): one the in-memory ring no longer holds (it
    ran before a restart, or the ring dropped it). Rows from before schema 4 have no span: 1 row, no tokens."""
    status = None if row["status"] == "pending" else row["status"]
    return RequestRecord(row["request_id"], row["kind"], row["session_id"], row["model_id"], row["owner"], None,
                         row["created_at"], row["size"] or 1, row["tokens_in"] or 0, row["started_at"],
                         row["finished_at"], status, row["tokens_out"] or 0)


def append_recent(rings: dict[str, deque], key: str, item, maxlen: int, max_keys: int) -> list[str]:
    """Append `item` to `key`'s ring (at most `maxlen` items, the oldest dropped) and make `key` the most recent
    (dicts keep insertion order); past `max_keys` keys the least recent go: returned."""
    ring = rings.pop(key, None)
    if ring is None:
        ring = deque(maxlen=maxlen)
    ring.append(item)
    rings[key] = ring
    dropped = []
    while len(rings) > max_keys:
        dropped.append(oldest := next(iter(rings)))
        del rings[oldest]
    return dropped


def session_of(op: Op) -> str | None:
    """The session a request belongs to: its own, else the one its model was created in."""
    if op.session_id is not None:
        return op.session_id
    return paths.session_of(op.model_id) if op.model_id else None


class Telemetry:
    def __init__(self, max_requests: int = MAX_REQUESTS, max_calls: int = MAX_CALLS,
                 max_queue_samples: int = MAX_QUEUE_SAMPLES, max_session_calls: int = MAX_SESSION_CALLS,
                 max_call_sessions: int = MAX_CALL_SESSIONS):
        self._lock = threading.Lock()
        self.requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self.calls: deque[CallRecord] = deque(maxlen=max_calls)
        # session -> the calls that ran its requests (the same records): a busy tenant filling the server-wide
        # ring does not drop another session's calls sooner than its own traffic would
        self._session_calls: dict[str, deque[CallRecord]] = {}
        self.max_session_calls, self.max_call_sessions = max_session_calls, max_call_sessions
        self.queue: deque[QueueSample] = deque(maxlen=max_queue_samples)
        self._open: dict[str, RequestRecord] = {}  # not finished yet (also when the ring dropped them)
        self._flight: dict[str, dict[str, int]] = {}  # base model -> session -> sequences sampling
        self.finished_by: dict[tuple[str, str], int] = {}  # (kind, status) -> requests
        self.latency: dict[str, Histogram] = {}  # kind -> accepted..finished seconds
        self.queue_wait: dict[str, Histogram] = {}  # kind -> accepted..started seconds
        self.tokens: dict[str, int] = {"trained": 0, "forward": 0, "sampled": 0, "prompt": 0}

    # ---- recording (engine and API threads) ----

    def accepted(self, op: Op, base_model: str | None = None, now: float | None = None) -> None:
        tokens = op.tokens
        if op.kind == "sample":
            tokens = len(op.payload.prompt) * op.payload.num_samples
        record = RequestRecord(op.request_id, op.kind, session_of(op), op.model_id, op.owner, base_model,
                               time.time() if now is None else now, op.size, tokens)
        with self._lock:
            self.requests.append(record)
            self._open[op.request_id] = record

    def started(self, ops: Iterable[Op], now: float) -> None:
        with self._lock:
            for op in ops:
                record = self._open.get(op.request_id)
                if record is None or record.started is not None:
                    continue
                record.started = now
                self._hist(self.queue_wait, record.kind).observe(now - record.accepted)
                if record.kind == "sample":
                    flight = self._flight.setdefault(record.base_model or "", {})
                    flight[record.session_id or ""] = flight.get(record.session_id or "", 0) + record.size

    def produced(self, request_id: str, tokens: int) -> None:
        """Tokens a sampling request generated (set before its result is written)."""
        with self._lock:
            if (record := self._open.get(request_id)) is not None:
                record.tokens_out = tokens

    def finished(self, results: Iterable[tuple[str, str]], now: float | None = None) -> None:
        """(request_id, "done" | "failed") of futures just written."""
        now = time.time() if now is None else now
        with self._lock:
            for request_id, status in results:
                record = self._open.pop(request_id, None)
                if record is None:
                    continue
                record.finished, record.status = now, status
                if record.started is None:  # refused before it ran: its wait is its latency
                    record.started = now
                    self._hist(self.queue_wait, record.kind).observe(now - record.accepted)
                elif record.kind == "sample":
                    self._leave_flight(record)
                key = (record.kind, status)
                self.finished_by[key] = self.finished_by.get(key, 0) + 1
                self._hist(self.latency, record.kind).observe(now - record.accepted)
                if status == "done":
                    if record.kind == "forward_backward":
                        self.tokens["trained"] += record.tokens_in
                    elif record.kind == "forward":
                        self.tokens["forward"] += record.tokens_in
                    elif record.kind == "sample":
                        self.tokens["sampled"] += record.tokens_out
                        self.tokens["prompt"] += record.tokens_in

    def call(self, kind: str, base_model: str, start: float, end: float, rows: int, tokens: int, ok: bool,
             shares: dict[str, tuple[int, int]] | None = None) -> None:
        """One backend call; `shares`: session -> (rows, tokens) of the requests it ran."""
        record = CallRecord(kind, base_model, start, end, rows, tokens, ok,
                            tuple((s, r, t) for s, (r, t) in (shares or {}).items()))
        with self._lock:
            self.calls.append(record)
            for session, _, _ in record.shares:
                if session:
                    append_recent(self._session_calls, session, record, self.max_session_calls, self.max_call_sessions)

    def call_of(self, kind: str, base_model: str, start: float, end: float, ops: list[Op], ok: bool) -> None:
        """A call that ran `ops` (rows: their datums or sequences; tokens: their input or prompt tokens)."""
        shares: dict[str, tuple[int, int]] = {}
        for op in ops:
            session = session_of(op) or ""
            r, t = shares.get(session, (0, 0))
            tokens = len(op.payload.prompt) * op.payload.num_samples if op.kind == "sample" else op.tokens
            shares[session] = (r + op.size, t + tokens)
        self.call(kind, base_model, start, end, sum(op.size for op in ops), sum(t for _, t in shares.values()), ok,
                  shares)

    def span_of(self, request_id: str) -> dict | None:
        """An open request's span as the store keeps it (`store.SPAN_COLUMNS`); None when not open."""
        with self._lock:
            if (r := self._open.get(request_id)) is None:
                return None
            return {"started_at": r.started, "size": r.size, "tokens_in": r.tokens_in, "tokens_out": r.tokens_out}

    def sampling_shares(self, base_model: str) -> dict[str, tuple[int, int]]:
        """Session -> (sequences in flight, 0) on `base_model`: the rows of its next sample_step (session ""
        for requests of no session)."""
        with self._lock:
            return {s: (n, 0) for s, n in self._flight.get(base_model, {}).items()}

    def queue_sample(self, now: float, training: int, samples: int, sample_sequences: int, sampling: int,
                     sampling_sequences: int) -> None:
        with self._lock:
            last = self.queue[-1] if self.queue else None
            values = (training, samples, sample_sequences, sampling, sampling_sequences)
            if last is not None and now - last.t < QUEUE_SAMPLE_S and values == (
                    last.training, last.samples, last.sample_sequences, last.sampling, last.sampling_sequences):
                return
            self.queue.append(QueueSample(now, *values))

    # ---- reading (API threads) ----

    def snapshot(self, since: float = 0.0, session_id: str | None = None
                 ) -> tuple[list[RequestRecord], list[CallRecord], list[QueueSample]]:
        """Copies of the records of requests and calls that ended at or after `since` (or are still open) and
        the queue samples since then; only one session's requests and calls when `session_id` is given
        (queue samples are server-wide: none for a session; its calls come from its own ring)."""
        with self._lock:  # the rings are copied (fast, in C) under the lock; filtered outside it
            ring, still_open, queue = list(self.requests), list(self._open.values()), list(self.queue)
            calls = list(self.calls if session_id is None else self._session_calls.get(session_id, ()))
        ringed = {id(r) for r in ring}
        picked = [r for r in ring + [r for r in still_open if id(r) not in ringed]
                  if (session_id is None or r.session_id == session_id) and (r.finished is None or r.finished >= since)]
        with self._lock:  # the engine updates open records in place: copy the picked ones consistently
            requests = [_copy(r) for r in picked]
        requests = [r for r in requests if r.finished is None or r.finished >= since]
        calls = [c for c in calls if c.end >= since
                 and (session_id is None or any(s == session_id for s, _, _ in c.shares))]
        queue = [] if session_id is not None else [q for q in queue if q.t >= since]
        requests.sort(key=lambda r: r.accepted)
        return requests, calls, queue

    def counters(self) -> tuple[dict[tuple[str, str], int], dict[str, Histogram], dict[str, Histogram],
                                dict[str, int]]:
        """Copies of the cumulative counters: finished requests, latency and queue-wait histograms, tokens."""
        with self._lock:
            return (dict(self.finished_by), {k: h.copy() for k, h in self.latency.items()},
                    {k: h.copy() for k, h in self.queue_wait.items()}, dict(self.tokens))

    def open_requests(self) -> int:
        with self._lock:
            return len(self._open)

    # ---- helpers ----

    @staticmethod
    def _hist(table: dict[str, Histogram], kind: str) -> Histogram:
        if (h := table.get(kind)) is None:
            h = table[kind] = Histogram()
        return h

    def _leave_flight(self, record: RequestRecord) -> None:
        flight, session = self._flight.get(record.base_model or "", {}), record.session_id or ""
        left = flight.get(session, 0) - record.size
        if left > 0:
            flight[session] = left
        else:
            flight.pop(session, None)


@dataclass(slots=True)
class StepPoint:
    step: int  # 1 for the model's first optim_step
    time: float  # when the optim_step finished
    loss_sum: float  # the step's forward_backward calls' metrics["loss:sum"], added up
    tokens: int  # their input tokens
    passes: int  # forward_backward calls in the step
    metrics: dict[str, float]  # their other metrics (":sum" added up, the rest the last call's) and optim_step's


class LossHistory:
    """Per model, a bounded list of its training steps, for the console's loss curves: forward_backward results
    accumulate until the model's optim_step closes the step. One small dict update per request, under a lock;
    the closed steps are also stored (the engine writes the row `optim_step` returns)."""

    def __init__(self, max_steps: int = MAX_STEPS, max_models: int = MAX_HISTORIES):
        self._lock = threading.Lock()
        self.max_steps, self.max_models = max_steps, max_models
        self._steps: dict[str, deque[StepPoint]] = {}  # model -> its steps (insertion order: least recent first)
        self._pending: dict[str, StepPoint] = {}  # model -> forward_backward results since its last optim_step
        self._count: dict[str, int] = {}  # model -> optim_steps seen

    def forward_backward(self, model_id: str, metrics: dict[str, float], tokens: int) -> None:
        with self._lock:
            p = self._pending.get(model_id)
            if p is None:
                p = self._pending[model_id] = StepPoint(0, 0.0, 0.0, 0, 0, {})
            p.loss_sum += float(metrics.get("loss:sum", 0.0))
            p.tokens += tokens
            p.passes += 1
            for k, v in metrics.items():
                if k != "loss:sum":
                    p.metrics[k] = p.metrics.get(k, 0.0) + float(v) if k.endswith(":sum") else float(v)

    def optim_step(self, model_id: str, metrics: dict[str, float], now: float | None = None) -> dict:
        """Close the model's step; returns it as a `store.train_steps` row (without model_id)."""
        with self._lock:
            step = self._count.get(model_id, 0) + 1
            self._count[model_id] = step
            p = self._pending.pop(model_id, None) or StepPoint(0, 0.0, 0.0, 0, 0, {})
            p.step, p.time = step, time.time() if now is None else now
            p.metrics.update({f"optim/{k}": float(v) for k, v in metrics.items()})
            for oldest in append_recent(self._steps, model_id, p, self.max_steps, self.max_models):
                self._count.pop(oldest, None)
                self._pending.pop(oldest, None)
            return step_row(p)

    def of(self, model_id: str) -> tuple[list[StepPoint], StepPoint | None]:
        """Copies of the model's steps and of its pending (not yet stepped) forward_backward results."""
        with self._lock:
            steps = list(self._steps.get(model_id, ()))
            pending = self._pending.get(model_id)
            return [_copy_step(s) for s in steps], None if pending is None else _copy_step(pending)


def step_row(s: StepPoint) -> dict:
    return {"step": s.step, "time": s.time, "loss_sum": s.loss_sum, "tokens": s.tokens, "passes": s.passes,
            "metrics": dict(s.metrics)}


def step_of_row(row: dict) -> StepPoint:
    return StepPoint(row["step"], row["time"], row["loss_sum"], row["tokens"], row["passes"], dict(row["metrics"]))


def _copy_step(s: StepPoint) -> StepPoint:
    return StepPoint(s.step, s.time, s.loss_sum, s.tokens, s.passes, dict(s.metrics))


def _copy(r: RequestRecord) -> RequestRecord:
    return RequestRecord(r.request_id, r.kind, r.session_id, r.model_id, r.owner, r.base_model, r.accepted, r.size,
                         r.tokens_in, r.started, r.finished, r.status, r.tokens_out)
