"""The engine: accepted requests become futures in the store; one thread on process 0 forms rounds
(see scheduler.py), calls the backend and writes the results of each backend call in one transaction
(see results.py: a write the store refuses is retried, never dropped).

Results are stored already encoded for the wire (the API passes in the encoders of the two protobuf
result types); every other result and every error is JSON.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from tx import types
from tx.checkpoints import storage
from tx.engine import paths
from tx.engine.config import EngineConfig  # noqa: F401 - re-exported
from tx.engine.ops import Op, RequestTooLarge, UserError
from tx.engine.results import (  # noqa: F401
    Encoded,
    ResultWriter,
    error_payload,
    finite_metrics,
    json_payload,
)
from tx.engine.sampling import SamplingMixin
from tx.engine.single_ops import SingleOpsMixin
from tx.engine.scheduler import Round, Scheduler
from tx.engine.store import Store
from tx.engine.telemetry import LossHistory, Telemetry

logger = logging.getLogger(__name__)
ACTIVE_S = 2.0  # a model that sent a request this recently is an active tenant, worth a batch window
REWRITE_S = 1.0  # while the store refuses results, try to write them again this often


class Engine(SamplingMixin, SingleOpsMixin):
    def __init__(self, backend, store: Store, config: EngineConfig, base_model: str,
                 encode_pass: Callable[[types.ForwardBackwardOutput], Encoded],
                 encode_sample: Callable[[types.SampleOutput], Encoded],
                 fatal: tuple[type[BaseException], ...] = (), extra_backends: dict[str, Any] | None = None):
        self.backend = backend  # of `base_model`, the default one
        # Several base models: a backend each, by public name; a model's ops go to the backend it was created on.
        self.backends = {base_model: backend, **(extra_backends or {})}
        self._base_of: dict[str, str] = {}  # model_id -> its base model, for models not of the default one
        self.store = store
        self.config = config
        self.base_model = base_model
        self.encode_pass = encode_pass
        self.encode_sample = encode_sample
        self.fatal = fatal
        self.scheduler = Scheduler(config.max_pass_datums, config.max_samples, config.seq_gap_timeout_s,
                                   config.max_pass_tokens)
        self.cond = threading.Condition()  # guards the scheduler; never held across store or backend I/O
        self.metrics: dict[str, int] = {}
        self.telemetry = Telemetry()  # per-request and per-call records: traces, session stats, Prometheus
        self.loss_history = LossHistory()  # per model: loss and metrics by step, for the console
        self.results = ResultWriter(store, self.count, on_written=self.telemetry.finished,
                                    span_of=self.telemetry.span_of)
        self.error: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # e.g. stop the HTTP server
        self._stop = False
        self._last_submit: dict[str, float] = {}  # model -> when it last sent a request
        self._ending: set[str] = set()  # sessions finished by the client, to unload at the next round
        self._next_housekeeping = 0.0
        self._deleted: list[str] = []  # deleted checkpoint locations the backend must stop serving
        self._in_flight: dict[str, tuple[str, Op]] = {}  # sampling requests a backend runs: id -> (base, op)
        self._in_flight_sequences = 0  # their sequences (read by API threads for back-pressure)
        self._thread = threading.Thread(target=self._loop, name="tx-engine", daemon=True)
        # Models the previous server held are no longer in the backend; what it never ran cannot run.
        for model_id in store.models_in_status("creating", "ready"):
            store.update_model(model_id, status="unloaded")
        for path in storage.sweep(config.checkpoint_root):
            logger.info("removed %s, left by a failed or interrupted save", path)
        failed = store.fail_pending("the server restarted before this request ran; submit it again")
        if failed:
            logger.warning("failed %d requests left pending by the previous server", failed)

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def count(self, name: str, n: int = 1) -> None:
        self.metrics[name] = self.metrics.get(name, 0) + n

    # ---- submission (API threads) ----

    def check_pass_size(self, datums: int, tokens: int) -> None:
        """Refuse a forward/forward_backward request that cannot run in one backend call."""
        c = self.config
        if datums > c.max_pass_datums:
            raise RequestTooLarge(f"data has {datums} datums; a request may hold at most max_pass_datums="
                                  f"{c.max_pass_datums} (the SDK splits larger batches)")
        if tokens > c.max_request_tokens:
            raise RequestTooLarge(f"data has {tokens} tokens; a request may hold at most max_request_tokens="
                                  f"{c.max_request_tokens} (the SDK splits larger batches)")

    def submit(self, kind: str, payload: Any, dedup_key: str | None = None, model_id: str | None = None,
               seq_id: int | None = None, session_id: str | None = None, size: int = 1, tokens: int = 0,
               owner: str | None = None) -> str:
        """Accept a request: its future's id (the original one for a retried dedup_key). The store is
        written outside the engine lock, so a slow database never stalls the engine or other submits.
        `owner`: the tenant that sent it."""
        with self.cond:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error}")
        if dedup_key is not None and (known := self.store.future_by_key(dedup_key)) is not None:
            return known
        with self.cond:
            self._check_seq(kind, model_id, seq_id)
        try:
            # the session a model's request belongs to is stored with it (the console's series after a restart)
            session = session_id if session_id is not None or model_id is None else paths.session_of(model_id)
            request_id, created = self.store.add_future(kind, dedup_key, model_id, session, owner)
        except sa.exc.IntegrityError:  # the same dedup_key raced in from another thread
            return self.store.future_by_key(dedup_key)
        if not created:
            return request_id
        op = Op(request_id, kind, payload, model_id, seq_id, session_id, size, tokens, owner)
        self.telemetry.accepted(op, payload.base_model or self.base_model if kind == "sample" else None)
        late = None
        with self.cond:
            try:  # while the future was written the model may have been unloaded or its seq_id gap skipped
                self._check_seq(kind, model_id, seq_id)
            except UserError as e:
                late = e
            else:
                self.scheduler.add(op)
                if model_id is not None:
                    self._last_submit[model_id] = time.time()
                self.count(f"submitted_{kind}")
                self.cond.notify_all()
        if late is not None:
            self.results.finish([(request_id, "failed", error_payload(str(late), "user"))])
        return request_id

    def _check_seq(self, kind: str, model_id: str | None, seq_id: int | None) -> None:
        if seq_id is None or kind in ("create_model", "create_from_state"):
            return
        expected = self.scheduler.expected_seq(model_id)
        if expected is None:
            raise UserError(f"model_id {model_id!r} is not loaded on this server")
        if seq_id < expected:
            raise UserError(f"seq_id {seq_id} of model {model_id} was already passed (next is {expected})")

    def queued_samples(self) -> int:
        with self.cond:
            return sum(op.size for op in self.scheduler.samples) + self._in_flight_sequences

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting and running now: `training` (sequenced ops queued per model), `samples` and
        `sample_sequences` (sampling requests not yet handed to a backend), `sampling` and
        `sampling_sequences` (in a backend)."""
        with self.cond:
            return self._depth()

    def _depth(self) -> dict[str, int]:  # under self.cond
        training, samples, sequences = self.scheduler.depth()
        return {"training": training, "samples": samples, "sample_sequences": sequences,
                "sampling": len(self._in_flight), "sampling_sequences": self._in_flight_sequences}

    def watch(self, request_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once the future is written (it may be called from the engine thread)."""
        self.results.watch(request_id, callback)

    def unwatch(self, request_id: str, callback: Callable[[], None]) -> None:
        self.results.unwatch(request_id, callback)

    def end_session(self, session_id: str) -> None:
        with self.cond:
            self._ending.add(session_id)
            self.cond.notify_all()

    # ---- the loop (engine thread) ----

    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while (not self._stop and not self._ending and not self._in_flight
                           and not self.scheduler.pending(time.time())):
                        wake = min(self._next_housekeeping, self.scheduler.next_deadline() or math.inf)
                        if self.results.kept:
                            wake = min(wake, time.time() + REWRITE_S)
                        if not self.cond.wait(timeout=min(max(0.01, wake - time.time()), 5.0)):
                            break  # housekeeping or a seq_id gap is due
                    if self._stop:
                        return
                    window = 0.0 if self._in_flight else self._batch_window(time.time())
                if window:
                    time.sleep(window)  # let other tenants' passes join this round
                with self.cond:
                    now = time.time()
                    depth = self._depth()  # before the round takes its requests: what waited for it
                    round_ = self.scheduler.next_round(now)
                self.telemetry.queue_sample(now, **depth)
                try:
                    if self.results.kept:
                        self.results.flush()
                    self._evict_deleted()
                    trained = self._execute(round_) if not round_.empty() else 0.0
                    if self._in_flight:
                        self._run_sampling(trained)
                    self._housekeeping()
                except self.fatal:
                    raise
                except Exception:  # noqa: BLE001 - e.g. the database went away: keep serving what can be
                    logger.exception("engine round failed")
                    self.count("engine_round_errors")
                    time.sleep(1.0)
        except self.fatal as e:
            logger.error("engine stopping: %s", e)
            with self.cond:
                self.error = e
            self._fail_in_flight(f"the engine stopped: {e}")
            if self.on_fatal is not None:
                self.on_fatal()

    def _batch_window(self, now: float) -> float:
        """Wait for other tenants only when some are active: a lone tenant's passes run at once."""
        ready = self.scheduler.ready_pass_models()
        if not ready:
            return 0.0
        others = any(m not in ready and now - t < ACTIVE_S for m, t in self._last_submit.items())
        return self.config.batch_window_s if others else 0.0

    def _finish(self, results: list[tuple[str, str, Encoded]], model_updates: list[tuple[str, dict]] = ()) -> None:
        self.results.finish(results, model_updates)  # kept in memory and written later if the store refuses

    def _failure(self, e: Exception) -> Encoded:
        if isinstance(e, self.fatal):
            raise e
        user = isinstance(e, (UserError, ValueError, storage.CheckpointNotFound, KeyError))
        if not user:
            logger.exception("request failed")
        return error_payload(str(e) if user else f"{type(e).__name__}: {e}", "user" if user else "server")

    def _backend_of(self, model_id: str | None):
        return self.backends[self._base_of.get(model_id, self.base_model)]

    def _by_base(self, ops: list[Op], base_of: Callable[[Op], str | None]) -> list[list[Op]]:
        """`ops` split by base model (one backend call each), in order of first appearance."""
        if len(self.backends) == 1:
            return [ops]
        groups: dict[str, list[Op]] = {}
        for op in ops:
            groups.setdefault(base_of(op) or self.base_model, []).append(op)
        return list(groups.values())

    def _execute(self, round_: Round) -> float:
        """Run a round's training ops, then submit its sampling requests; seconds the training ops took."""
        started = time.perf_counter()
        self.count("rounds")
        for kind, ops in round_.passes.items():
            for group in self._by_base(ops, lambda op: self._base_of.get(op.model_id)) if ops else []:
                self._run_passes(kind, group)
        for op in round_.singles:
            self._run_single(op)
        trained = time.perf_counter() - started
        for group in self._by_base(round_.samples, lambda op: op.payload.base_model) if round_.samples else []:
            self._submit_samples(group)
        return trained

    def _run_passes(self, kind: str, ops: list[Op]) -> None:
        """One backend call for the passes of every model in the round."""
        batch = {k: [] for k in ("all_input_ids", "all_targets", "all_token_weights", "all_sampling_logprobs",
                                 "all_advantages", "all_model_ids", "all_loss_fns", "all_loss_fn_configs",
                                 "all_ratio_masks")}
        slices = []
        for op in ops:
            self.count(f"{kind}_requests_{op.payload.loss_fn}")  # shows which losses the clients ran
            start = len(batch["all_input_ids"])
            for d in op.payload.datums:
                batch["all_input_ids"].append(d.input_ids)
                batch["all_targets"].append(d.targets)
                batch["all_token_weights"].append(d.weights)
                batch["all_sampling_logprobs"].append(d.logprobs)
                batch["all_advantages"].append(d.advantages)
                batch["all_ratio_masks"].append(d.ratio_mask)
                batch["all_model_ids"].append(op.model_id)
                batch["all_loss_fns"].append(op.payload.loss_fn)
                batch["all_loss_fn_configs"].append(op.payload.loss_fn_config)
            slices.append((op.request_id, op.model_id, start, len(batch["all_input_ids"])))
        datums = [d for op in ops for d in op.payload.datums]
        extra_keys = sorted({k for d in datums for k in d.extra_inputs})
        batch["all_extra_inputs"] = {k: [d.extra_inputs.get(k, []) for d in datums] for k in extra_keys} or None
        tenants = len({op.model_id for op in ops})
        self.count(f"{kind}_calls")
        if tenants > 1:
            self.count(f"cross_tenant_{kind}_calls")
        results = self._batch_call(
            kind, ops, lambda: getattr(self._backend_of(ops[0].model_id), kind)(
                types.PreparedModelPassBatch(**batch, request_batch_slices=slices)),
            lambda op, out: self._encode_pass(kind, op, out), tenants=tenants, datums=len(batch["all_input_ids"]))
        if results is not None:
            now = time.time()
            self._finish(results, [(m, {"last_request_time": now}) for m in {op.model_id for op in ops}])

    def _encode_pass(self, kind: str, op: Op, out: types.ForwardBackwardOutput) -> Encoded:
        if kind == "forward_backward":
            self.loss_history.forward_backward(op.model_id, out.metrics, op.tokens)
        return self.encode_pass(out)

    def _batch_call(self, event: str, ops: list[Op], call: Callable[[], dict], encode: Callable[[Op, Any], Encoded],
                    **fields) -> list[tuple[str, str, Encoded]] | None:
        """Run one backend call for `ops`; their results (or, when the call raised, nothing: all failed)."""
        started = time.perf_counter()
        start = time.time()
        self.telemetry.started(ops, start)
        base = self._base_of.get(ops[0].model_id, self.base_model)
        try:
            outputs = call()
        except Exception as e:  # noqa: BLE001 - every request of the call gets the error
            self.telemetry.call_of(event, base, start, time.time(), ops, ok=False)
            payload = self._failure(e)
            self._finish([(op.request_id, "failed", payload) for op in ops])
            return None
        self.telemetry.call_of(event, base, start, time.time(), ops, ok=True)
        logger.info(json.dumps({"event": event, "requests": len(ops), **fields,
                                "seconds": round(time.perf_counter() - started, 4)}))
        results = []
        for op in ops:
            out = outputs[op.request_id]
            if isinstance(out, types.ErrorResponse):
                results.append((op.request_id, "failed", error_payload(out.error, "user")))
            else:
                results.append((op.request_id, "done", encode(op, out)))
        return results

    def _run_single(self, op: Op) -> None:
        start, base, ok = time.time(), self._base_of.get(op.model_id, self.base_model), False
        self.telemetry.started([op], start)
        try:
            try:
                result, updates = getattr(self, f"_do_{op.kind}")(op)
                ok = True
            finally:
                if op.kind != "rejected":  # refused at submit: no backend call
                    self.telemetry.call_of(op.kind, self._base_of.get(op.model_id, base), start, time.time(), [op], ok)
        except Exception as e:  # noqa: BLE001 - reported on this request's future
            updates = []
            if op.kind in ("create_model", "create_from_state"):
                updates = [(op.model_id, {"status": "failed"})]
                with self.cond:
                    self.scheduler.drop_model(op.model_id)
            self._finish([(op.request_id, "failed", self._failure(e))], updates)
            return
        now = time.time()
        steps = []
        if op.kind == "optim_step":  # closes a step of the run's loss history, stored with the result
            steps = [(op.model_id, self.loss_history.optim_step(op.model_id, result["metrics"], now))]
        self.results.finish([(op.request_id, "done", json_payload(result))],
                            [(op.model_id, {"last_request_time": now, **u}) for u in updates] if op.model_id else [],
                            steps)

    # ---- housekeeping: expired sessions and checkpoints ----

    def _housekeeping(self) -> None:
        now = time.time()
        with self.cond:
            ending, self._ending = self._ending, set()
        if not ending and now < self._next_housekeeping:
            return
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + min(5.0, self.config.session_timeout_s / 4)
            with self.cond:
                self._last_submit = {m: t for m, t in self._last_submit.items() if now - t < ACTIVE_S}
            for session_id in self.store.stale_sessions(now - self.config.session_timeout_s):
                if self.store.end_session(session_id, "expired"):
                    logger.info("session %s expired (no heartbeat for %.0f s)", session_id,
                                self.config.session_timeout_s)
                    ending.add(session_id)
            for ckpt in self.store.expired_checkpoints(now):
                self.delete_checkpoint_files(ckpt["location"])
                self.store.delete_checkpoint(ckpt["model_id"], ckpt["kind"], ckpt["name"])
        for session_id in ending:
            models, _ = self.store.list_models(session_id=session_id)
            for model in models:
                if model["status"] in ("ready", "creating"):
                    self._do_unload_model(Op("", "unload_model", None, model["model_id"]))
                    self.store.update_model(model["model_id"], status="unloaded")
                    logger.info("unloaded %s (session %s ended)", model["model_id"], session_id)

    def _evict_deleted(self) -> None:
        with self.cond:
            deleted, self._deleted = self._deleted, []
        for where in deleted:
            for backend in self.backends.values():
                backend.evict_sampler_checkpoint(where)

    def delete_checkpoint_files(self, where: str) -> None:
        """Remove a checkpoint's files (any thread); the engine thread then evicts it from the backend."""
        with self.cond:
            self._deleted.append(where)
            self.cond.notify_all()
        try:
            storage.remove(storage.as_path(where))
        except OSError as e:
            logger.warning("could not delete checkpoint files %s: %s", where, e)
