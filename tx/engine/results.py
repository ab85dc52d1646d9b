"""Writing finished requests to the store so that no future stays pending while the server runs.

A round's results are written with a few quick retries (a database blip). When the store still refuses
them (disk full, database down) they are kept in memory, in order, and written again on the engine's
next tries; a result the store keeps refusing while it accepts a short failure note (e.g. a payload too
large for a nearly full disk) is replaced by that note. Watchers of a future are woken only once its row
is written, so a long-poll never reads a pending row after its wake-up.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

Encoded = tuple[str, bytes]
Result = tuple[str, str, Encoded]  # (request_id, "done" | "failed", (content_type, payload))


@dataclass
class _Kept:
    results: list[Result]
    model_updates: list[tuple[str, dict]]
    steps: list[tuple[str, dict]]
    since: float
    error: str

    def nbytes(self) -> int:
        return sum(len(body) for _, _, (_, body) in self.results)


def error_payload(message: str, category: str) -> Encoded:
    return "application/json", json.dumps({"error": message, "category": category}).encode()


def json_payload(value: dict) -> Encoded:
    return "application/json", json.dumps(value, allow_nan=False).encode()


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics as JSON numbers. The backend refuses a step whose metrics are not finite, so one here is a
    bug: it is reported (the request fails naming it), never dropped."""
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise RuntimeError(f"the backend returned non-finite metrics {bad}; the step's result cannot be reported")
    return {k: float(v) for k, v in metrics.items()}


def _note(message: str) -> Encoded:
    return "application/json", json.dumps({"error": message, "category": "server"}).encode()


class ResultWriter:
    def __init__(self, store, count: Callable[[str], None], attempts: int = 5, backoff_s: float = 0.05,
                 max_kept_bytes: int = 256 << 20, on_written: Callable[[list[tuple[str, str]]], None] | None = None,
                 span_of: Callable[[str], dict | None] | None = None):
        """`on_written`: called with (request_id, status) of the futures each write made visible; `span_of`:
        a request's span columns (`store.SPAN_COLUMNS`) to write with its result, None when unknown."""
        self.store = store
        self.count = count
        self.on_written = on_written
        self.span_of = span_of
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_kept_bytes = max_kept_bytes
        self.kept: list[_Kept] = []  # what the store refused, oldest first
        self._write_lock = threading.Lock()  # one writer at a time keeps the kept results in order
        self._watch_lock = threading.Lock()  # held only for dict updates, never across I/O
        self._watchers: dict[str, list[Callable[[], None]]] = {}

    # ---- watchers (API threads) ----

    def watch(self, request_id: str, callback: Callable[[], None]) -> None:
        with self._watch_lock:
            self._watchers.setdefault(request_id, []).append(callback)

    def unwatch(self, request_id: str, callback: Callable[[], None]) -> None:
        with self._watch_lock:
            callbacks = self._watchers.get(request_id, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._watchers.pop(request_id, None)

    # ---- writing ----

    def finish(self, results: Iterable[Result], model_updates: Iterable[tuple[str, dict]] = (),
               steps: Iterable[tuple[str, dict]] = ()) -> bool:
        """Write `results`, model row changes and training steps (model_id, `store.train_steps` row) in one
        transaction, retrying briefly. False: the store refused them and they are kept (written by a later
        `flush`)."""
        results, model_updates, steps = list(results), list(model_updates), list(steps)
        with self._write_lock:
            if self.kept and not self._flush():  # older results first; the store is still refusing
                self._keep(results, model_updates, steps, self.kept[-1].error)
                return False
            error = None
            for attempt in range(self.attempts):
                if attempt:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    self._write(results, model_updates, steps)
                except Exception as e:  # noqa: BLE001 - any store failure: the results must not be lost
                    error = f"{type(e).__name__}: {e}"
                    self.count("store_write_errors")
                    continue
                self._written(results)
                return True
            logger.error("could not write %d results after %d attempts (%s); keeping them to write when the "
                         "store recovers", len(results), self.attempts, error)
            self._keep(results, model_updates, steps, error)
            return False

    def flush(self) -> bool:
        """Write what the store refused before; True when nothing is left."""
        with self._write_lock:
            return self._flush()

    def _flush(self) -> bool:
        while self.kept:
            kept = self.kept[0]
            written = kept.results
            try:
                self._write(kept.results, kept.model_updates, kept.steps)
            except Exception as e:  # noqa: BLE001 - maybe only the full results do not fit: try short notes
                self.count("store_write_errors")
                message = (f"this request ran, but its result could not be stored ({type(e).__name__}: {e}; "
                           f"first failure {time.time() - kept.since:.0f} s ago: {kept.error})")
                notes = [(rid, "failed", _note(message)) for rid, _, _ in kept.results]
                try:
                    self._write(notes, kept.model_updates, kept.steps)
                except Exception:  # noqa: BLE001 - the store still refuses writes: try again later
                    return False
                written = notes
            self.kept.pop(0)
            self._written(written)
            logger.warning("wrote %d results kept since the store refused them %.1f s ago", len(kept.results),
                           time.time() - kept.since)
        return True

    def _keep(self, results: list[Result], model_updates: list[tuple[str, dict]], steps: list[tuple[str, dict]],
              error: str) -> None:
        used = sum(k.nbytes() for k in self.kept)
        if used + sum(len(body) for _, _, (_, body) in results) > self.max_kept_bytes:
            # memory is bounded: past the cap only a failure note is kept for each request
            message = f"this request ran, but its result could not be stored: {error}"
            results = [(rid, "failed", _note(message)) for rid, _, _ in results]
        self.kept.append(_Kept(results, model_updates, steps, time.time(), error))

    def _write(self, results: list[Result], model_updates: list[tuple[str, dict]],
               steps: list[tuple[str, dict]]) -> None:
        spans = {}
        if self.span_of is not None:
            spans = {rid: span for rid, _, _ in results if (span := self.span_of(rid)) is not None}
        self.store.finish_futures([(rid, status, ct, body) for rid, status, (ct, body) in results], model_updates,
                                  spans, steps)

    def _written(self, results: list[Result]) -> None:
        if self.on_written is not None:  # before the watchers wake: a woken client then sees its record finished
            self.on_written([(rid, status) for rid, status, _ in results])
        with self._watch_lock:
            callbacks = [cb for rid, _, _ in results for cb in self._watchers.pop(rid, [])]
        for cb in callbacks:
            cb()
        for _, status, _ in results:
            self.count("requests_failed" if status == "failed" else "requests_done")

    def pending_writes(self) -> int:
        """Results the store refused, kept in memory to write later (read without the write lock, which a
        failing store holds for seconds)."""
        return sum(len(k.results) for k in list(self.kept))
