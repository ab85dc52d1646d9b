"""Store: the service's durable state, on SQLite and on a real PostgreSQL server (same tests on both)."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest
import sqlalchemy as sa

from tests.pg_server import PostgresUnavailable, postgres_server
from tests.require import skip_or_fail
from tx.engine import schema as schema_mod
from tx.engine import store as store_mod
from tx.engine.schema import SCHEMA_VERSION, SchemaError
from tx.engine.store import FutureRow, Store


class Clock:
    """Stands in for the `time` module inside tx.engine.store, so created_at/heartbeat values are exact."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def time(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


@pytest.fixture(scope="module")
def pg_server_url(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(postgres_server(tmp_path_factory.mktemp("pg")))
        except PostgresUnavailable as e:
            skip_or_fail(str(e))
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """A URL of an empty database of each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tx.sqlite'}"
        return
    server = sa.engine.make_url(request.getfixturevalue("pg_server_url"))
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    admin.dispose()
    yield server.set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(store_mod, "time", c)
    return c


@pytest.fixture
def store(url, clock):
    s = Store(url)
    yield s
    s.close()


def schema_versions(url: str) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(schema_mod.schema_info.c.version)).scalars())
    finally:
        engine.dispose()


def set_schema_version(url: str, version: int) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(schema_mod.schema_info.update().values(version=version))
    finally:
        engine.dispose()


def columns(url: str, table: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        return [c["name"] for c in sa.inspect(engine).get_columns(table)]
    finally:
        engine.dispose()


def old_schema(*without: str) -> sa.MetaData:
    """The tables of an older schema: today's without the columns named and without schema 4's train_steps."""
    old = sa.MetaData()
    for table in schema_mod.metadata.tables.values():
        if table.name != "train_steps":
            sa.Table(table.name, old, *[c._copy() for c in table.columns if c.name not in without])
    return old


# ---- backend setup ----


def test_sqlite_uses_wal(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    try:
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar().lower() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        s.close()


def test_database_url(tmp_path):
    assert store_mod.database_url(tmp_path / "d", "postgresql+psycopg://h/db") == "postgresql+psycopg://h/db"
    assert not (tmp_path / "d").exists()
    assert store_mod.database_url(tmp_path / "d", None) == f"sqlite:///{tmp_path / 'd' / 'tx.sqlite'}"
    assert (tmp_path / "d").is_dir()


def test_new_database_is_created_at_the_current_version(store, url):
    assert schema_versions(url) == [SCHEMA_VERSION]
    engine = sa.create_engine(url)
    try:
        tables = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"tx_schema", "sessions", "models", "futures", "checkpoints", "sampling_sessions"} <= tables


# ---- sessions ----


def test_create_and_read_session(store, clock):
    sid = store.create_session(["a", "b"], {"k": "v", "n": 1}, "0.38.0", "my run", "tenant-a")
    assert sid.startswith("sess-")
    row = store.session(sid)
    assert row == {"session_id": sid, "created_at": 1000.0, "last_heartbeat": 1000.0, "status": "active",
                   "tags": ["a", "b"], "user_metadata": {"k": "v", "n": 1}, "sdk_version": "0.38.0",
                   "display_name": "my run", "owner": "tenant-a"}
    assert store.session("sess-unknown") is None
    other = store.create_session([], {}, None, None)
    assert other != sid
    assert store.session(other)["sdk_version"] is None


def test_list_sessions_newest_first(store, clock):
    ids = []
    for _ in range(3):
        ids.append(store.create_session([], {}, None, None))
        clock.tick()
    assert store.list_sessions(10, 0) == ids[::-1]
    assert store.list_sessions(1, 1) == [ids[1]]


def test_heartbeat(store, clock):
    sid = store.create_session([], {}, None, None)
    clock.tick(5)
    assert store.heartbeat(sid) == "active"
    assert store.session(sid)["last_heartbeat"] == 1005.0
    assert store.heartbeat("sess-unknown") is None
    assert store.end_session(sid, "finished")
    clock.tick(5)
    assert store.heartbeat(sid) == "finished"  # an ended session is not revived
    assert store.session(sid)["last_heartbeat"] == 1005.0
    assert store.session(sid)["status"] == "finished"


def test_end_session_first_wins(store):
    sid = store.create_session([], {}, None, None)
    assert store.end_session(sid, "finished") is True
    assert store.end_session(sid, "expired") is False
    assert store.session(sid)["status"] == "finished"
    assert store.end_session("sess-unknown", "finished") is False


def test_stale_sessions(store, clock):
    old = store.create_session([], {}, None, None)
    ended = store.create_session([], {}, None, None)
    store.end_session(ended, "finished")
    clock.tick(100)
    fresh = store.create_session([], {}, None, None)
    refreshed = store.create_session([], {}, None, None)
    clock.tick(100)  # now 1200
    assert store.heartbeat(refreshed) == "active"
    assert store.stale_sessions(older_than=1050.0) == [old]  # strictly older; ended ones are not stale
    assert sorted(store.stale_sessions(older_than=1150.0)) == sorted([old, fresh])
    assert store.stale_sessions(older_than=1000.0) == []


# ---- models ----


def test_add_get_update_model(store, clock):
    store.add_model("s1:train:0", "s1", "Qwen/Qwen3-0.6B", {"rank": 8, "alpha": 8.0}, {"note": "x"}, "tenant-a")
    row = store.model("s1:train:0")
    assert row == {"model_id": "s1:train:0", "session_id": "s1", "base_model": "Qwen/Qwen3-0.6B",
                   "lora_config": {"rank": 8, "alpha": 8.0}, "user_metadata": {"note": "x"}, "status": "creating",
                   "created_at": 1000.0, "last_request_time": 1000.0, "owner": "tenant-a"}
    assert store.model("s1:train:1") is None
    store.update_model("s1:train:0", status="ready", last_request_time=1234.5)
    row = store.model("s1:train:0")
    assert row["status"] == "ready" and row["last_request_time"] == 1234.5
    assert row["created_at"] == 1000.0
    store.update_model("s1:train:0", lora_config={"rank": 16})
    assert store.model("s1:train:0")["lora_config"] == {"rank": 16}


def test_add_model_twice_is_refused(store):
    store.add_model("s1:train:0", "s1", "base", {}, {})
    with pytest.raises(sa.exc.IntegrityError):
        store.add_model("s1:train:0", "s1", "base", {}, {})


def test_list_models_filters_by_session_and_counts(store, clock):
    for sid, n in (("s1", 3), ("s2", 2)):
        for i in range(n):
            store.add_model(f"{sid}:train:{i}", sid, "base", {}, {})
            clock.tick()
    rows, total = store.list_models()
    assert total == 5
    assert [r["model_id"] for r in rows] == ["s2:train:1", "s2:train:0", "s1:train:2", "s1:train:1", "s1:train:0"]
    rows, total = store.list_models(session_id="s1")
    assert total == 3 and [r["model_id"] for r in rows] == ["s1:train:2", "s1:train:1", "s1:train:0"]
    rows, total = store.list_models(limit=1, offset=1, session_id="s1")
    assert total == 3 and [r["model_id"] for r in rows] == ["s1:train:1"]  # total counts all, not the page
    rows, total = store.list_models(2, 0)
    assert total == 5 and len(rows) == 2
    assert store.list_models(session_id="nobody") == ([], 0)


def test_models_in_status(store):
    for i, status in enumerate(["creating", "ready", "failed", "unloaded", "ready"]):
        store.add_model(f"s:train:{i}", "s", "base", {}, {})
        store.update_model(f"s:train:{i}", status=status)
    assert sorted(store.models_in_status("ready")) == ["s:train:1", "s:train:4"]
    assert sorted(store.models_in_status("creating", "ready")) == ["s:train:0", "s:train:1", "s:train:4"]
    assert store.models_in_status("nothing") == []


# ---- futures ----


def test_add_future_without_key_always_creates(store):
    a, created_a = store.add_future("sample", None)
    b, created_b = store.add_future("sample", None)
    assert created_a and created_b and a != b
    assert store.future(a) == FutureRow(a, "sample", None, "pending", None, None)


def test_add_future_dedup_returns_the_original(store):
    rid, created = store.add_future("forward_backward", "train:m:1", "m", "s")
    assert created is True and rid.startswith("req-")
    again, created_again = store.add_future("forward_backward", "train:m:1", "m", "s")
    assert (again, created_again) == (rid, False)
    assert store.future_by_key("train:m:1") == rid
    assert store.future_by_key("train:m:2") is None
    other, created_other = store.add_future("forward_backward", "train:m:2", "m", "s")
    assert created_other and other != rid
    row = store.future(rid)
    assert row == FutureRow(rid, "forward_backward", "m", "pending", None, None)
    assert store.future("req-unknown") is None


def test_add_future_dedup_holds_after_it_finished(store):
    rid, _ = store.add_future("optim_step", "train:m:3", "m")
    store.finish_futures([(rid, "done", "application/json", b"{}")])
    assert store.add_future("optim_step", "train:m:3", "m") == (rid, False)
    assert store.future(rid).status == "done"


def test_finish_futures_writes_results_and_model_updates(store, clock):
    store.add_model("m:train:0", "s", "base", {}, {})
    a, _ = store.add_future("forward_backward", None, "m:train:0")
    b, _ = store.add_future("forward_backward", None, "m:train:0")
    untouched, _ = store.add_future("sample", None)
    clock.tick(7)
    payload = bytes(range(256))  # binary results (protobuf) survive as they are
    store.finish_futures([(a, "done", "application/x-protobuf", payload),
                          (b, "failed", "application/json", b'{"error": "bad"}')],
                         [("m:train:0", {"status": "ready", "last_request_time": 1007.0})])
    assert store.future(a) == FutureRow(a, "forward_backward", "m:train:0", "done", "application/x-protobuf", payload)
    assert store.future(b).status == "failed" and store.future(b).result == b'{"error": "bad"}'
    assert store.future(untouched).status == "pending"
    model = store.model("m:train:0")
    assert model["status"] == "ready" and model["last_request_time"] == 1007.0


def test_finish_futures_is_one_transaction(store):
    store.add_model("m:train:0", "s", "base", {}, {})
    rid, _ = store.add_future("optim_step", None, "m:train:0")
    with pytest.raises(sa.exc.SQLAlchemyError):  # the model update names a column that does not exist
        store.finish_futures([(rid, "done", "application/json", b"{}")], [("m:train:0", {"no_such_column": 1})])
    assert store.future(rid).status == "pending"  # the result written before the failure was rolled back
    assert store.future(rid).result is None
    assert store.model("m:train:0")["status"] == "creating"


def test_spans_and_train_steps_are_written_with_the_results(store, clock):
    """What the console reads after a restart: each future's span and each run's steps, in one transaction."""
    a, _ = store.add_future("forward_backward", None, "s:train:0", "s")
    clock.tick(1)
    b, _ = store.add_future("optim_step", None, "s:train:0", "s")
    elsewhere, _ = store.add_future("sample", None, None, "t")
    clock.tick(4)  # finished_at 1005
    step = {"step": 1, "time": 1004.5, "loss_sum": 3.25, "tokens": 16, "passes": 1, "metrics": {"optim/lr": 0.001}}
    store.finish_futures([(a, "done", "application/json", b"{}"), (b, "done", "application/json", b"{}"),
                          (elsewhere, "failed", "application/json", b"{}")],
                         spans={a: {"started_at": 1002.0, "size": 2, "tokens_in": 16, "tokens_out": 0},
                                elsewhere: {"started_at": None, "size": 4, "tokens_in": 12, "tokens_out": 8}},
                         steps=[("s:train:0", step), ("s:train:0", {**step, "step": 2, "loss_sum": 1.5})])
    pending, _ = store.add_future("optim_step", None, "s:train:0", "s")
    rows = store.request_spans(1005.0, "s")
    assert [r["request_id"] for r in rows] == [a, b, pending]
    assert rows[0] == {"request_id": a, "kind": "forward_backward", "session_id": "s", "model_id": "s:train:0",
                       "owner": None, "created_at": 1000.0, "finished_at": 1005.0, "status": "done",
                       "started_at": 1002.0, "size": 2, "tokens_in": 16, "tokens_out": 0}
    assert rows[1]["size"] is None and rows[2]["status"] == "pending" and rows[2]["finished_at"] is None
    assert [r["request_id"] for r in store.request_spans(1005.5, "s")] == [pending]  # finished before `since`
    assert [r["tokens_out"] for r in store.request_spans(0.0, "t")] == [8]
    assert len(store.request_spans(0.0)) == 4 and [r["request_id"] for r in store.request_spans(0.0, limit=1)] == \
        [pending]  # the most recently accepted
    steps = store.train_steps("s:train:0")
    assert steps == [step, {**step, "step": 2, "loss_sum": 1.5}]
    assert store.train_steps("s:train:0", limit=1) == steps[1:] and store.train_steps("other") == []
    # a failing write stores no step either
    c, _ = store.add_future("optim_step", None, "s:train:0", "s")
    with pytest.raises(sa.exc.SQLAlchemyError):
        store.finish_futures([(c, "done", "application/json", b"{}")], [("s:train:0", {"no_such_column": 1})],
                             steps=[("s:train:0", {**step, "step": 3})])
    assert len(store.train_steps("s:train:0")) == 2 and store.future(c).status == "pending"


def test_fail_pending(store, clock):
    done, _ = store.add_future("optim_step", "k1")
    store.finish_futures([(done, "done", "application/json", b'{"ok": true}')])
    pending = [store.add_future("forward_backward", f"k{i}")[0] for i in range(2, 5)]
    clock.tick(3)
    assert store.fail_pending("the server restarted") == 3
    for rid in pending:
        row = store.future(rid)
        assert row.status == "failed" and row.content_type == "application/json"
        assert json.loads(row.result) == {"error": "the server restarted", "category": "server"}
    assert store.future(done).status == "done" and store.future(done).result == b'{"ok": true}'
    assert store.fail_pending("again") == 0


# ---- checkpoints ----


def put(store, model_id="m:train:0", kind="weights", name="c1", location="/ck/c1", expires_at=None,
        size_bytes=10, user_metadata=None):
    store.put_checkpoint(model_id, kind, name, location, expires_at, size_bytes, user_metadata or {})


def test_put_and_get_checkpoint(store):
    put(store, expires_at=2000.0, size_bytes=12 << 30, user_metadata={"step": "10"})
    assert store.checkpoint("m:train:0", "weights", "c1") == {
        "model_id": "m:train:0", "kind": "weights", "name": "c1", "location": "/ck/c1", "created_at": 1000.0,
        "expires_at": 2000.0, "size_bytes": 12 << 30, "user_metadata": {"step": "10"}, "owner": None,
        "public": False}
    assert store.checkpoint("m:train:0", "sampler_weights", "c1") is None  # the key includes the kind
    assert store.checkpoint("m:train:1", "weights", "c1") is None


def test_put_checkpoint_overwrites(store, clock):
    put(store, location="/old", expires_at=5000.0, user_metadata={"v": "1"})
    clock.tick(10)
    put(store, location="/new", expires_at=None, size_bytes=None, user_metadata={"v": "2"})
    row = store.checkpoint("m:train:0", "weights", "c1")
    assert row["location"] == "/new" and row["created_at"] == 1010.0
    assert row["expires_at"] is None and row["size_bytes"] is None and row["user_metadata"] == {"v": "2"}
    assert store.list_checkpoints()[1] == 1


def test_list_checkpoints_newest_first(store, clock):
    put(store, name="a")
    clock.tick()
    put(store, name="b", kind="sampler_weights")
    clock.tick()
    put(store, model_id="m:train:1", name="c")
    clock.tick()
    put(store, name="a")  # re-saving makes it the newest
    rows, total = store.list_checkpoints()
    assert total == 3 and [(r["model_id"], r["name"]) for r in rows] == [
        ("m:train:0", "a"), ("m:train:1", "c"), ("m:train:0", "b")]
    rows, total = store.list_checkpoints("m:train:0")
    assert total == 2 and [r["name"] for r in rows] == ["a", "b"]
    rows, total = store.list_checkpoints(None, limit=1, offset=1)
    assert total == 3 and [r["name"] for r in rows] == ["c"]
    assert store.list_checkpoints("m:train:9") == ([], 0)


def test_delete_checkpoint(store):
    put(store, name="a")
    put(store, name="b")
    assert store.delete_checkpoint("m:train:0", "weights", "a") is True
    assert store.delete_checkpoint("m:train:0", "weights", "a") is False
    assert store.checkpoint("m:train:0", "weights", "a") is None
    assert store.checkpoint("m:train:0", "weights", "b") is not None
    assert store.delete_checkpoint("m:train:0", "sampler_weights", "b") is False


def test_set_checkpoint_expiry_and_expired_checkpoints(store):
    put(store, name="never")
    put(store, name="soon", expires_at=1500.0)
    put(store, name="later", expires_at=3000.0)
    assert [r["name"] for r in store.expired_checkpoints(now=2000.0)] == ["soon"]
    assert store.expired_checkpoints(now=1500.0) == []  # expires_at must be strictly in the past
    assert store.set_checkpoint_expiry("m:train:0", "weights", "never", 1800.0) is True
    assert store.set_checkpoint_expiry("m:train:0", "weights", "soon", None) is True
    assert store.set_checkpoint_expiry("m:train:0", "weights", "missing", 1.0) is False
    assert store.checkpoint("m:train:0", "weights", "never")["expires_at"] == 1800.0
    assert [r["name"] for r in store.expired_checkpoints(now=2000.0)] == ["never"]
    assert sorted(r["name"] for r in store.expired_checkpoints(now=1e12)) == ["later", "never"]


# ---- sampling sessions ----


def test_sampling_sessions(store, clock):
    store.add_sampling_session("s1:sample:0", "s1", "base", "tinker://s1:train:0/sampler_weights/x", "/ck/x.tar.gz")
    clock.tick()
    store.add_sampling_session("s1:sample:0", "s1", "other", None, None)  # a retry: the first one stays
    store.add_sampling_session("s1:sample:1", "s1", "base", None, None)
    store.add_sampling_session("s2:sample:0", "s2", "base", None, None)
    assert store.sampling_session("s1:sample:0") == {
        "sampling_session_id": "s1:sample:0", "session_id": "s1", "base_model": "base",
        "model_path": "tinker://s1:train:0/sampler_weights/x", "location": "/ck/x.tar.gz", "created_at": 1000.0,
        "owner": None}
    assert store.sampling_session("s1:sample:1")["model_path"] is None
    assert store.sampling_session("s1:sample:9") is None
    assert sorted(store.sampling_session_ids("s1")) == ["s1:sample:0", "s1:sample:1"]
    assert store.sampling_session_ids("nobody") == []


# ---- tenants ----


def test_rows_carry_their_owner_and_listings_filter_by_it(store, clock):
    """Checkpoints inherit their model's owner, sampling sessions their session's; None lists everyone's."""
    a = store.create_session([], {}, None, None, "tenant-a")
    clock.tick()
    b = store.create_session([], {}, None, None, "tenant-b")
    store.add_model(f"{a}:train:0", a, "base", {}, {}, "tenant-a")
    store.add_model(f"{b}:train:0", b, "base", {}, {}, "tenant-b")
    put(store, model_id=f"{a}:train:0")
    put(store, model_id=f"{b}:train:0")
    put(store, model_id="gone:train:0")  # a model the store does not know: nobody's
    store.add_sampling_session(f"{a}:sample:0", a, "base", None, None)
    rid, _ = store.add_future("sample", None, owner="tenant-b")
    assert store.future(rid).owner == "tenant-b"
    assert store.sampling_session(f"{a}:sample:0")["owner"] == "tenant-a"
    assert store.checkpoint(f"{b}:train:0", "weights", "c1")["owner"] == "tenant-b"
    assert store.checkpoint("gone:train:0", "weights", "c1")["owner"] is None
    assert store.list_sessions(10, 0, "tenant-a") == [a]
    assert store.list_sessions(10, 0) == [b, a]
    assert store.list_sessions(10, 0, "tenant-c") == []
    rows, total = store.list_models(owner="tenant-b")
    assert total == 1 and [r["model_id"] for r in rows] == [f"{b}:train:0"]
    rows, total = store.list_checkpoints(owner="tenant-a")
    assert total == 1 and rows[0]["model_id"] == f"{a}:train:0"
    assert store.list_checkpoints()[1] == 3
    assert store.list_checkpoints(f"{a}:train:0", owner="tenant-b") == ([], 0)


def test_schema_1_database_gets_owner_columns(url):
    """A database written by schema 1 (no owner columns) is migrated; its rows belong to nobody."""
    v1 = old_schema("owner", "public", *schema_mod.SPAN_COLUMNS)  # the columns schemas 2-4 added
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            v1.create_all(conn)
            conn.execute(v1.tables["tx_schema"].insert().values(version=1))
            conn.execute(v1.tables["sessions"].insert().values(
                session_id="sess-old", created_at=1.0, last_heartbeat=1.0, status="active", tags=[], user_metadata={}))
        assert "owner" not in columns(url, "sessions")
        s = Store(url)
        try:
            assert s.session("sess-old")["owner"] is None
            assert s.list_sessions(10, 0, "tenant-a") == [] and s.list_sessions(10, 0) == ["sess-old"]
            new = s.create_session([], {}, None, None, "tenant-a")
            assert s.list_sessions(10, 0, "tenant-a") == [new]
        finally:
            s.close()
        assert schema_versions(url) == [SCHEMA_VERSION] == [4]
        for table in schema_mod.OWNED_TABLES:
            assert "owner" in columns(url, table.name)
            assert f"ix_{table.name}_owner" in {i["name"] for i in sa.inspect(engine).get_indexes(table.name)}
    finally:
        engine.dispose()


def test_schema_3_database_gets_spans_and_train_steps(url):
    """A schema 3 database (no span columns, no train_steps) is migrated; its futures keep their rows."""
    v3 = old_schema(*schema_mod.SPAN_COLUMNS)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            v3.create_all(conn)
            conn.execute(v3.tables["tx_schema"].insert().values(version=3))
            conn.execute(v3.tables["futures"].insert().values(
                request_id="req-old", kind="optim_step", session_id="s", status="done", created_at=1.0,
                finished_at=2.0))
        s = Store(url)
        try:
            (old,) = s.request_spans(0.0, "s")
            assert old["request_id"] == "req-old" and old["started_at"] is None and old["size"] is None
            new, _ = s.add_future("optim_step", None, "s:train:0", "s")
            s.finish_futures([(new, "done", "application/json", b"{}")], spans={new: {"size": 1}},
                             steps=[("s:train:0", {"step": 1, "time": 3.0, "loss_sum": 0.5, "tokens": 4,
                                                   "passes": 1, "metrics": {}})])
            assert [r["size"] for r in s.request_spans(0.0, "s")] == [None, 1]
            assert [r["step"] for r in s.train_steps("s:train:0")] == [1]
        finally:
            s.close()
        assert schema_versions(url) == [4]
        assert set(schema_mod.SPAN_COLUMNS) <= set(columns(url, "futures"))
        assert "ix_futures_finished_at" in {i["name"] for i in sa.inspect(engine).get_indexes("futures")}
    finally:
        engine.dispose()


# ---- restarts and schema versions ----


def test_state_survives_a_new_store(url, clock):
    first = Store(url)
    sid = first.create_session(["t"], {}, None, None)
    first.add_model("m:train:0", sid, "base", {"rank": 4}, {})
    rid, _ = first.add_future("create_model", "create:m:0", "m:train:0", sid)
    put(first)
    first.add_sampling_session("m:sample:0", sid, "base", None, None)
    first.close()

    second = Store(url)  # a restarted server
    try:
        assert second.session(sid)["tags"] == ["t"]
        assert second.model("m:train:0")["lora_config"] == {"rank": 4}
        assert second.future(rid).status == "pending"
        assert second.add_future("create_model", "create:m:0") == (rid, False)
        assert second.checkpoint("m:train:0", "weights", "c1")["location"] == "/ck/c1"
        assert second.sampling_session("m:sample:0") is not None
        assert second.fail_pending("restarted") == 1
    finally:
        second.close()
    assert schema_versions(url) == [SCHEMA_VERSION]  # reopening adds no second version row


def test_newer_schema_is_refused(url):
    Store(url).close()
    set_schema_version(url, SCHEMA_VERSION + 1)
    with pytest.raises(SchemaError) as e:
        Store(url)
    message = str(e.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert f"up to {SCHEMA_VERSION}" in message
    assert schema_versions(url) == [SCHEMA_VERSION + 1]  # left as it was


def _add_note_column(conn) -> None:
    conn.exec_driver_sql("ALTER TABLE models ADD COLUMN note VARCHAR(64)")
    conn.exec_driver_sql("UPDATE models SET note = 'migrated'")


def test_older_schema_is_migrated(url, monkeypatch):
    old = Store(url)
    old.add_model("m:train:0", "s", "base", {}, {})
    old.close()
    calls = []

    def v1_to_v2(conn):
        calls.append(SCHEMA_VERSION)
        _add_note_column(conn)

    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setattr(schema_mod, "MIGRATIONS", {SCHEMA_VERSION: v1_to_v2})
    Store(url).close()
    assert calls == [SCHEMA_VERSION]
    assert "note" in columns(url, "models")
    assert schema_versions(url) == [SCHEMA_VERSION + 1]
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT note FROM models").scalar() == "migrated"
    finally:
        engine.dispose()
    Store(url).close()  # now current: nothing runs again
    assert calls == [SCHEMA_VERSION]


def test_migrations_run_in_order_over_several_versions(url, monkeypatch):
    Store(url).close()
    calls = []
    steps = {SCHEMA_VERSION + i: (lambda conn, i=i: calls.append(SCHEMA_VERSION + i)) for i in range(3)}
    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 3)
    monkeypatch.setattr(schema_mod, "MIGRATIONS", steps)
    Store(url).close()
    assert calls == [SCHEMA_VERSION, SCHEMA_VERSION + 1, SCHEMA_VERSION + 2]
    assert schema_versions(url) == [SCHEMA_VERSION + 3]


def test_failed_migration_leaves_the_database_as_it_was(url, monkeypatch):
    Store(url).close()

    def broken(conn):
        _add_note_column(conn)
        raise RuntimeError("migration bug")

    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setattr(schema_mod, "MIGRATIONS", {SCHEMA_VERSION: broken})
    with pytest.raises(RuntimeError, match="migration bug"):
        Store(url)
    assert schema_versions(url) == [SCHEMA_VERSION]
    # All or nothing: the step's DDL must be rolled back too, or re-running it after a fix fails
    # ("duplicate column") and the database is stuck between versions.
    assert "note" not in columns(url, "models")
    monkeypatch.setattr(schema_mod, "MIGRATIONS", {SCHEMA_VERSION: _add_note_column})
    Store(url).close()
    assert schema_versions(url) == [SCHEMA_VERSION + 1]


def test_concurrent_submits_finishes_and_heartbeats_never_see_database_locked(tmp_path):
    """Issue 12 #7: two submitting threads, a finisher and heartbeats on one SQLite file. A read-then-write
    transaction (add_future's dedup lookup, heartbeat's status check) that began deferred could not wait
    for the writer and failed at once with "database is locked"; BEGIN IMMEDIATE makes it wait."""
    import threading
    import time

    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    session_id = store.create_session([], {}, None, None)
    errors: list[str] = []
    ops: list[str] = []
    pending: list[str] = []
    lock, stop = threading.Lock(), threading.Event()

    def guarded(name: str, fn) -> None:
        try:
            fn()
            ops.append(name)
        except sa.exc.OperationalError as e:
            errors.append(f"{name}: {e.orig}")

    def submit(thread: int) -> None:
        for i in range(500):
            def add(i=i):
                request_id, _ = store.add_future("forward_backward", f"train:m{thread}:{i}", f"m{thread}", session_id)
                with lock:
                    pending.append(request_id)
            guarded("submit", add)

    def finish() -> None:
        while not stop.is_set() or pending:
            with lock:
                batch, pending[:] = pending[:], []
            if batch:
                guarded("finish", lambda: store.finish_futures([(r, "done", "application/json", b"{}") for r in batch]))
            else:
                time.sleep(0.001)

    def beat() -> None:
        while not stop.is_set():
            guarded("heartbeat", lambda: store.heartbeat(session_id))
            time.sleep(0.002)

    submitters = [threading.Thread(target=submit, args=(t,)) for t in range(2)]
    background = [threading.Thread(target=finish), threading.Thread(target=beat)]
    for t in submitters + background:
        t.start()
    for t in submitters:
        t.join()
    stop.set()
    for t in background:
        t.join()
    assert errors == [], f"{len(errors)} of {len(errors) + len(ops)} operations failed, e.g. {errors[0]}"
    assert ops.count("submit") == 1000
    with store.engine.connect() as conn:
        statuses = conn.execute(sa.select(schema_mod.futures.c.status, sa.func.count())
                                .group_by(schema_mod.futures.c.status)).all()
    assert dict(statuses) == {"done": 1000}
    store.close()


def test_sqlite_reads_do_not_wait_for_an_open_write(tmp_path):
    """Write transactions start with BEGIN IMMEDIATE; reads stay deferred, so in WAL mode they answer while
    a writer holds the lock."""
    import time

    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    request_id, _ = store.add_future("optim_step", None)
    with store.engine.begin() as writer:  # holds SQLite's write lock until the block ends
        writer.execute(schema_mod.futures.update().values(status="failed"))
        started = time.monotonic()
        assert store.future(request_id).status == "pending"  # the committed state, without waiting
        assert time.monotonic() - started < 1.0
    assert store.future(request_id).status == "failed"
    store.close()


def test_schema_2_database_gets_public_column(url):
    """A schema-2 database (no checkpoints.public) is migrated; its checkpoints stay private."""
    v2 = old_schema("public", *schema_mod.SPAN_COLUMNS)  # the columns schemas 3-4 added
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            v2.create_all(conn)
            conn.execute(v2.tables["tx_schema"].insert().values(version=2))
            conn.execute(v2.tables["checkpoints"].insert().values(
                model_id="m:train:0", kind="weights", name="c1", location="/ck", created_at=1.0, user_metadata={}))
        assert "public" not in columns(url, "checkpoints")
        s = Store(url)
        try:
            assert s.checkpoint("m:train:0", "weights", "c1")["public"] is False
            from tx.engine import store_weights
            assert store_weights.set_public(s, "m:train:0", "weights", "c1", True) is True
            assert store_weights.set_public(s, "m:train:0", "weights", "c1", True) is False
            assert store_weights.set_public(s, "m:train:0", "weights", "nope", True) is None
            assert s.checkpoint("m:train:0", "weights", "c1")["public"] is True
        finally:
            s.close()
        assert schema_versions(url) == [SCHEMA_VERSION] == [4]
    finally:
        engine.dispose()
