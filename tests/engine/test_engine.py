"""The engine thread with a stand-in backend and a real SQLite store: it sleeps while the only queued
work waits on a missing seq_id (no busy loop) and skips the gap after seq_gap_timeout_s; refused
requests keep their place; sessions without heartbeat expire and their models are unloaded; a restart
fails what never ran and keeps what did."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from tx import types
from tx.engine.engine import Engine, EngineConfig
from tx.engine.ops import CreateRequest, UserError
from tx.engine.schema import sessions
from tx.engine.store import Store

MODEL = "sess-a:train:0"


class FakeBackend:
    def __init__(self):
        self.models: set[str] = set()
        self.steps: list[str] = []

    def create_model(self, model_id, lora_config):
        self.models.add(model_id)

    def has_model(self, model_id):
        return model_id in self.models

    def delete_model(self, model_id):
        self.models.discard(model_id)

    def optim_step(self, model_id, request):
        self.steps.append(model_id)
        return SimpleNamespace(metrics={"lr": 1e-4})


def no_encoder(_output):
    raise AssertionError("no pass or sample runs here")


@pytest.fixture
def make_engine(tmp_path):
    made = []

    def make(seq_gap_timeout_s: float = 60.0, session_timeout_s: float = 600.0) -> Engine:
        store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
        config = EngineConfig(checkpoint_root=str(tmp_path / "ck"), seq_gap_timeout_s=seq_gap_timeout_s,
                              session_timeout_s=session_timeout_s)
        eng = Engine(FakeBackend(), store, config, "base", no_encoder, no_encoder)
        eng.rounds = []  # the `now` of every next_round call
        next_round = eng.scheduler.next_round
        eng.scheduler.next_round = lambda now: (eng.rounds.append(now), next_round(now))[1]
        made.append(eng)
        eng.start()
        if store.session("sess-a") is None:
            with store.engine.begin() as conn:  # a session with a known id (create_session draws one)
                conn.execute(sessions.insert().values(session_id="sess-a", created_at=time.time(),
                                                      last_heartbeat=time.time(), status="active", tags=[],
                                                      user_metadata={}))
        store.add_model(MODEL, "sess-a", "base", {}, {})
        create = eng.submit("create_model", CreateRequest(None), "create:sess-a:0", MODEL, 0, "sess-a")
        assert wait_for(lambda: store.future(create).status != "pending", 10.0)
        assert store.future(create).status == "done"
        return eng

    yield make
    for eng in made:
        eng.stop()
        eng.store.close()


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_engine_sleeps_while_a_seq_gap_blocks(make_engine):
    engine = make_engine(seq_gap_timeout_s=60.0)
    engine.submit("optim_step", types.AdamParams(), "train:a:2", MODEL, 2, "sess-a")  # seq 1 never comes
    time.sleep(0.1)
    before = len(engine.rounds)
    time.sleep(0.5)
    idle_rounds = len(engine.rounds) - before
    engine.stop()  # stop spinning before the report
    # A sleeping engine wakes for housekeeping (every few seconds) or a new request: a handful at most.
    assert idle_rounds <= 10, f"engine ran {idle_rounds} empty rounds in 0.5 s while seq 1 was missing"
    assert engine.backend.steps == []


def test_engine_skips_a_seq_gap_after_the_timeout(make_engine):
    engine = make_engine(seq_gap_timeout_s=0.3)
    submitted = time.monotonic()
    step = engine.submit("optim_step", types.AdamParams(), "train:a:2", MODEL, 2, "sess-a")  # seq 1 never comes
    assert wait_for(lambda: engine.store.future(step).status != "pending", 10.0)
    waited = time.monotonic() - submitted
    assert engine.store.future(step).status == "done"
    assert engine.backend.steps == [MODEL]
    assert waited >= 0.3
    assert engine.scheduler.expected_seq(MODEL) == 3


def test_refused_request_keeps_its_place(make_engine):
    engine = make_engine()
    refused = engine.submit("rejected", "loss_fn 'x' is not supported", "train:a:1", MODEL, 1, "sess-a")
    step = engine.submit("optim_step", types.AdamParams(), "train:a:2", MODEL, 2, "sess-a")
    assert wait_for(lambda: engine.store.future(step).status != "pending", 5.0)
    failed = engine.store.future(refused)
    assert failed.status == "failed" and json.loads(failed.result) == {"error": "loss_fn 'x' is not supported",
                                                                       "category": "user"}
    assert engine.store.future(step).status == "done" and engine.backend.steps == [MODEL]
    # a retry of a refused or finished seq_id returns its future; an older unknown one is refused
    assert engine.submit("optim_step", types.AdamParams(), "train:a:2", MODEL, 2, "sess-a") == step
    with pytest.raises(UserError, match="already passed"):
        engine.submit("optim_step", types.AdamParams(), "train:a:0", MODEL, 0, "sess-a")


def test_session_without_heartbeat_expires_and_unloads_its_models(make_engine):
    engine = make_engine()
    assert engine.backend.has_model(MODEL)
    engine.config.session_timeout_s = 0.4  # only now: a slow machine must not expire it before the create
    assert wait_for(lambda: engine.store.model(MODEL)["status"] == "unloaded", 10.0)
    assert not engine.backend.has_model(MODEL)
    assert engine.store.session("sess-a")["status"] == "expired"
    with pytest.raises(UserError, match="not loaded"):
        engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")


def test_restart_fails_what_never_ran_and_keeps_results(make_engine, tmp_path):
    engine = make_engine()
    done = engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")
    assert wait_for(lambda: engine.store.future(done).status == "done", 5.0)
    stuck = engine.submit("optim_step", types.AdamParams(), "train:a:3", MODEL, 3, "sess-a")  # waits for seq 2
    engine.stop()
    store = Store(engine.store.url)
    again = Engine(FakeBackend(), store, engine.config, "base", no_encoder, no_encoder)
    assert json.loads(store.future(done).result) == {"metrics": {"lr": 1e-4}}
    lost = store.future(stuck)
    assert lost.status == "failed" and "restarted" in json.loads(lost.result)["error"]
    assert store.model(MODEL)["status"] == "unloaded"
    again.stop()
    store.close()


def test_expired_checkpoints_are_deleted_with_their_files(make_engine, tmp_path):
    engine = make_engine()  # housekeeping (expiry included) runs at least every 5 s
    old, kept = tmp_path / "old.tar.gz", tmp_path / "kept"
    old.write_bytes(b"x")
    kept.mkdir()
    (kept / "state").write_bytes(b"y")
    engine.store.put_checkpoint(MODEL, "sampler_weights", "old", str(old), time.time() - 1, 1, {})
    engine.store.put_checkpoint(MODEL, "weights", "kept", str(kept), None, 1, {})
    assert wait_for(lambda: engine.store.checkpoint(MODEL, "sampler_weights", "old") is None, 10.0)
    assert not old.exists()
    assert engine.store.checkpoint(MODEL, "weights", "kept") is not None and (kept / "state").exists()


def test_batch_window_only_when_another_tenant_is_active(tmp_path):
    from tx.engine.ops import Op

    store = Store(f"sqlite:///{tmp_path / 'w.sqlite'}")
    engine = Engine(FakeBackend(), store, EngineConfig(checkpoint_root=str(tmp_path), batch_window_s=0.25), "base",
                    no_encoder, no_encoder)
    other = "sess-b:train:0"
    engine.scheduler.add(Op("c", "create_model", None, MODEL, 0))
    engine.scheduler.next_round(0.0)
    engine.scheduler.add(Op("p", "forward_backward", None, MODEL, 1))
    now = time.time()
    engine._last_submit = {MODEL: now}
    assert engine._batch_window(now) == 0.0  # alone: run at once
    engine._last_submit[other] = now - 0.5
    assert engine._batch_window(now) == 0.25  # another tenant is mid-step: let its pass join
    engine._last_submit[other] = now - 60
    assert engine._batch_window(now) == 0.0  # it went quiet
    store.close()


# ---- issue 12 #6: a round's results are never lost to a store that refuses writes ----

def failing_writes(monkeypatch, store, times: int | None):
    """Make store.finish_futures raise like a database blip `times` times (None: until `state["ok"]`)."""
    real = store.finish_futures
    state = {"failed": 0, "ok": False}

    def finish(*args, **kwargs):
        if not state["ok"] and (times is None or state["failed"] < times):
            state["failed"] += 1
            raise sa.exc.OperationalError("UPDATE futures", {}, Exception("disk I/O error"))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "finish_futures", finish)
    return state


def test_a_result_write_that_fails_briefly_is_retried(make_engine, monkeypatch):
    engine = make_engine()
    state = failing_writes(monkeypatch, engine.store, times=2)
    step = engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")
    assert wait_for(lambda: engine.store.future(step).status != "pending", 10.0), "the future was orphaned"
    assert state["failed"] == 2
    row = engine.store.future(step)
    assert row.status == "done" and json.loads(row.result) == {"metrics": {"lr": 1e-4}}


def test_results_the_store_refuses_for_long_are_written_when_it_recovers(make_engine, monkeypatch):
    engine = make_engine()
    state = failing_writes(monkeypatch, engine.store, times=None)
    woken = []
    first = engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")
    engine.watch(first, lambda: woken.append(first))
    assert wait_for(lambda: engine.backend.steps == [MODEL], 5.0)
    second = engine.submit("optim_step", types.AdamParams(), "train:a:2", MODEL, 2, "sess-a")  # runs meanwhile
    assert wait_for(lambda: engine.backend.steps == [MODEL, MODEL], 5.0)
    time.sleep(1.5)  # past the quick retries: the results are kept in memory
    assert engine.store.future(first).status == "pending" and woken == []
    assert engine.error is None and engine._thread.is_alive()
    state["ok"] = True  # the store accepts writes again
    recovered = time.monotonic()
    assert wait_for(lambda: engine.store.future(second).status != "pending", 5.0), "a future stayed pending"
    assert time.monotonic() - recovered < 3.0
    for request_id in (first, second):
        row = engine.store.future(request_id)
        assert row.status == "done" and json.loads(row.result) == {"metrics": {"lr": 1e-4}}
    assert woken == [first]  # the long-poll of the first future is woken once it is written
    # a kept batch leaves memory just after the store took it (a reader may see the row first)
    assert wait_for(lambda: engine.results.kept == [], 2.0)


class BigMetricsBackend(FakeBackend):
    def optim_step(self, model_id, request):
        self.steps.append(model_id)
        return SimpleNamespace(metrics={f"metric_{i:05d}": float(i) for i in range(4000)})  # ~100 KB of JSON


def test_a_request_running_when_the_disk_fills_ends_after_space_returns(tmp_path, caplog):
    """A real SQLite 'database or disk is full' (PRAGMA max_page_count caps the file at its current size),
    then space returns: the request that ran meanwhile ends with its result."""
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    limit = {"pages": 2**30}
    sa.event.listen(store.engine, "checkout",
                    lambda dbapi, _rec, _proxy: dbapi.execute(f"PRAGMA max_page_count={limit['pages']}"))
    engine = Engine(BigMetricsBackend(), store, EngineConfig(checkpoint_root=str(tmp_path / "ck")), "base",
                    no_encoder, no_encoder)
    engine.start()
    try:
        store.add_model(MODEL, "sess-a", "base", {}, {})
        create = engine.submit("create_model", CreateRequest(None), "create:sess-a:0", MODEL, 0, "sess-a")
        assert wait_for(lambda: store.future(create).status == "done", 10.0)
        with store.engine.connect() as conn:
            limit["pages"] = conn.exec_driver_sql("PRAGMA page_count").scalar() + 2  # the disk is (nearly) full
        step = engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")
        assert wait_for(lambda: engine.backend.steps == [MODEL], 5.0)
        time.sleep(1.5)
        assert store.future(step).status == "pending"
        limit["pages"] = 2**30  # space returns
        assert wait_for(lambda: store.future(step).status != "pending", 5.0), "the request never ended"
        assert "database or disk is full" in caplog.text  # the write really failed for want of space
        row = store.future(step)
        assert row.status == "done" and len(json.loads(row.result)["metrics"]) == 4000
    finally:
        engine.stop()
        store.close()


# ---- issue 12 #8: the store is written outside the engine lock; dedup and seq order still hold ----

def slow_add_future(monkeypatch, store, seconds: float):
    real = store.add_future

    def add(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "add_future", add)


def test_racing_submits_of_one_key_share_one_future(make_engine, monkeypatch):
    import threading

    engine = make_engine()
    slow_add_future(monkeypatch, engine.store, 0.05)
    ids: list[str] = []
    threads = [threading.Thread(target=lambda: ids.append(
        engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 6 and len(set(ids)) == 1
    assert wait_for(lambda: engine.store.future(ids[0]).status == "done", 5.0)
    time.sleep(0.2)
    assert engine.backend.steps == [MODEL]  # it ran once


def test_a_slow_store_write_does_not_hold_the_engine_lock(make_engine, monkeypatch):
    import threading

    engine = make_engine()
    slow_add_future(monkeypatch, engine.store, 1.0)
    threading.Thread(target=engine.submit, args=("optim_step", types.AdamParams(), "train:a:1", MODEL, 1,
                                                 "sess-a")).start()
    time.sleep(0.2)  # the submit is inside the slow write
    started = time.monotonic()
    with engine.cond:
        took = time.monotonic() - started
    assert took < 0.1, f"the engine lock was held {took:.2f} s across a store write"


def test_a_model_unloaded_while_its_request_was_written_fails_that_request(make_engine, monkeypatch):
    import threading

    engine = make_engine()
    slow_add_future(monkeypatch, engine.store, 0.5)
    ids: list[str] = []
    t = threading.Thread(target=lambda: ids.append(
        engine.submit("optim_step", types.AdamParams(), "train:a:1", MODEL, 1, "sess-a")))
    t.start()
    time.sleep(0.2)
    with engine.cond:
        engine.scheduler.drop_model(MODEL)  # as an unload does, while the future is being written
    t.join()
    row = engine.store.future(ids[0])
    assert row.status == "failed" and "not loaded" in json.loads(row.result)["error"]


def test_a_request_must_fit_one_backend_call():
    """Issue 12 #12: max_request_tokens above max_pass_tokens is refused, naming both fields."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_request_tokens 2000 exceeds max_pass_tokens 1000"):
        EngineConfig(checkpoint_root="x", max_request_tokens=2000, max_pass_tokens=1000)
    assert EngineConfig(checkpoint_root="x").max_request_tokens <= EngineConfig(checkpoint_root="x").max_pass_tokens


def test_non_finite_metrics_are_reported_not_dropped():
    from tx.engine.engine import finite_metrics

    assert finite_metrics({"grad_norm": 2.0, "learning_rate": 1e-4}) == {"grad_norm": 2.0, "learning_rate": 1e-4}
    with pytest.raises(RuntimeError, match="learning_rate"):
        finite_metrics({"grad_norm": 2.0, "learning_rate": float("inf")})
