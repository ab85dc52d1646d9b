"""The service's durable state: sessions, models, futures, checkpoints and sampling sessions.

SQLAlchemy Core over SQLite (default; a file under the data directory, WAL mode so the API's readers
never wait on the engine's writer) or PostgreSQL (`--database-url postgresql+psycopg://...`). The schema
carries a version row (tx/engine/schema.py: the tables and their migrations): a new database is created at the
current version, an older one is migrated, a newer one is refused.

Every row carries its tenant: `owner`, a SHA-256 hex digest of the API key that created it (keys are
never stored). Rows from before schema 2 have no owner: only an admin key sees them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from tx.engine import schema
from tx.engine.schema import SPAN_COLUMNS, checkpoints, futures, models, sampling_sessions, sessions, train_steps


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    kind: str
    model_id: str | None
    status: str
    content_type: str | None
    result: bytes | None
    owner: str | None = None


def database_url(data_dir: Path, url: str | None) -> str:
    if url:
        return url
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{data_dir / 'tx.sqlite'}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # pysqlite commits before DDL on its own; take over transactions so a migration is all or nothing
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer and vice versa
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps the file consistent
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    """A transaction takes SQLite's write lock at BEGIN unless it only reads. A deferred transaction that
    reads and then writes cannot wait for a busy writer: SQLite answers "database is locked" at once
    (busy_timeout does not apply to that upgrade), while BEGIN IMMEDIATE waits up to busy_timeout."""
    read_only = conn.get_execution_options().get("tx_read_only", False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


class Store:
    def __init__(self, url: str):
        self.url = url
        kwargs: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs["pool_pre_ping"] = True
        self.engine: Engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
            sa.event.listen(self.engine, "begin", _sqlite_begin)
        self._reads = self.engine.execution_options(tx_read_only=True)  # transactions that never write
        try:
            self._migrate()
        except BaseException:
            self.engine.dispose()
            raise

    def _migrate(self) -> None:
        with self.engine.begin() as conn:
            schema.migrate(conn, self.url)

    def close(self) -> None:
        self.engine.dispose()

    # ---- sessions ----

    def create_session(self, tags: list[str], user_metadata: dict, sdk_version: str | None,
                       display_name: str | None, owner: str | None = None) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:16]}"
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(sessions.insert().values(
                session_id=session_id, created_at=now, last_heartbeat=now, status="active", tags=tags,
                user_metadata=user_metadata, sdk_version=sdk_version, display_name=display_name, owner=owner))
        return session_id

    def session(self, session_id: str) -> dict | None:
        with self._reads.connect() as conn:
            row = conn.execute(sessions.select().where(sessions.c.session_id == session_id)).mappings().first()
        return dict(row) if row else None

    def list_sessions(self, limit: int, offset: int, owner: str | None = None) -> list[str]:
        """Newest first; `owner` None = every tenant's (admin)."""
        with self._reads.connect() as conn:
            q = sa.select(sessions.c.session_id).where(*_of(sessions, owner)).order_by(sessions.c.created_at.desc()).limit(limit).offset(offset)
            return list(conn.execute(q).scalars())

    def heartbeat(self, session_id: str) -> str | None:
        """Refresh an active session; returns its status (None when unknown)."""
        with self.engine.begin() as conn:
            status = conn.execute(sa.select(sessions.c.status).where(sessions.c.session_id == session_id)).scalar()
            if status == "active":
                conn.execute(sessions.update().where(sessions.c.session_id == session_id)
                             .values(last_heartbeat=time.time()))
        return status

    def end_session(self, session_id: str, status: str) -> bool:
        """Finish or expire an active session (first wins). True if this call ended it."""
        with self.engine.begin() as conn:
            done = conn.execute(sessions.update().where(sessions.c.session_id == session_id,
                                                        sessions.c.status == "active").values(status=status))
        return done.rowcount == 1

    def stale_sessions(self, older_than: float) -> list[str]:
        with self._reads.connect() as conn:
            q = sa.select(sessions.c.session_id).where(sessions.c.status == "active",
                                                        sessions.c.last_heartbeat < older_than)
            return list(conn.execute(q).scalars())

    # ---- models ----

    def add_model(self, model_id: str, session_id: str, base_model: str, lora_config: dict,
                  user_metadata: dict, owner: str | None = None) -> None:
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(models.insert().values(
                model_id=model_id, session_id=session_id, base_model=base_model, lora_config=lora_config,
                user_metadata=user_metadata, status="creating", created_at=now, last_request_time=now, owner=owner))

    def model(self, model_id: str) -> dict | None:
        with self._reads.connect() as conn:
            row = conn.execute(models.select().where(models.c.model_id == model_id)).mappings().first()
        return dict(row) if row else None

    def list_models(self, limit: int = 1000, offset: int = 0, session_id: str | None = None,
                    owner: str | None = None) -> tuple[list[dict], int]:
        with self._reads.connect() as conn:
            where = _of(models, owner) + ([] if session_id is None else [models.c.session_id == session_id])
            total = conn.execute(sa.select(sa.func.count()).select_from(models).where(*where)).scalar()
            q = models.select().where(*where).order_by(models.c.created_at.desc()).limit(limit).offset(offset)
            return [dict(r) for r in conn.execute(q).mappings()], total

    def update_model(self, model_id: str, **values) -> None:
        with self.engine.begin() as conn:
            conn.execute(models.update().where(models.c.model_id == model_id).values(**values))

    def models_in_status(self, *statuses: str) -> list[str]:
        with self._reads.connect() as conn:
            return list(conn.execute(sa.select(models.c.model_id).where(models.c.status.in_(statuses))).scalars())

    # ---- futures ----

    def add_future(self, kind: str, dedup_key: str | None, model_id: str | None = None,
                   session_id: str | None = None, owner: str | None = None) -> tuple[str, bool]:
        """A new pending future, or (when `dedup_key` was seen before) the original one: (id, created)."""
        request_id = f"req-{uuid.uuid4().hex}"
        with self.engine.begin() as conn:
            if dedup_key is not None:
                found = conn.execute(sa.select(futures.c.request_id).where(futures.c.dedup_key == dedup_key)).scalar()
                if found is not None:
                    return found, False
            conn.execute(futures.insert().values(
                request_id=request_id, kind=kind, dedup_key=dedup_key, model_id=model_id, session_id=session_id,
                status="pending", created_at=time.time(), owner=owner))
        return request_id, True

    def future(self, request_id: str) -> FutureRow | None:
        with self._reads.connect() as conn:
            row = conn.execute(futures.select().where(futures.c.request_id == request_id)).mappings().first()
        if row is None:
            return None
        return FutureRow(row["request_id"], row["kind"], row["model_id"], row["status"], row["content_type"],
                         row["result"], row["owner"])

    def future_by_key(self, dedup_key: str) -> str | None:
        with self._reads.connect() as conn:
            return conn.execute(sa.select(futures.c.request_id).where(futures.c.dedup_key == dedup_key)).scalar()

    def finish_futures(self, results: Iterable[tuple[str, str, str, bytes]],
                       model_updates: Iterable[tuple[str, dict]] = (), spans: dict[str, dict] | None = None,
                       steps: Iterable[tuple[str, dict]] = ()) -> None:
        """Write (request_id, status, content_type, payload) results, model changes, the requests' `spans`
        (request_id -> values of SPAN_COLUMNS) and training steps ((model_id, train_steps row)) in one
        transaction."""
        now, spans = time.time(), spans or {}
        with self.engine.begin() as conn:
            for request_id, status, content_type, payload in results:
                conn.execute(futures.update().where(futures.c.request_id == request_id).values(
                    status=status, content_type=content_type, result=payload, finished_at=now,
                    **spans.get(request_id, {})))
            for model_id, values in model_updates:
                conn.execute(models.update().where(models.c.model_id == model_id).values(**values))
            for model_id, step in steps:
                conn.execute(train_steps.insert().values(model_id=model_id, **step))

    def request_spans(self, since: float, session_id: str | None = None, limit: int = 100_000) -> list[dict]:
        """The requests (of one session, or all) finished at or after `since` or still pending, the most
        recently accepted `limit` of them, oldest first: request_id, kind, session_id, model_id, owner,
        created_at, finished_at, status and SPAN_COLUMNS (None for rows written before schema 4)."""
        c = futures.c
        query = sa.select(c.request_id, c.kind, c.session_id, c.model_id, c.owner, c.created_at, c.finished_at,
                          c.status, *(c[name] for name in SPAN_COLUMNS))
        query = query.where(sa.or_(c.finished_at >= since, c.finished_at.is_(None)))
        if session_id is not None:
            query = query.where(c.session_id == session_id)
        with self._reads.connect() as conn:
            rows = conn.execute(query.order_by(c.created_at.desc()).limit(limit)).mappings().all()
        return [dict(r) for r in reversed(rows)]

    def train_steps(self, model_id: str, limit: int = 10_000) -> list[dict]:
        """The run's last `limit` training steps, in order (step, time, loss_sum, tokens, passes, metrics)."""
        c = train_steps.c
        query = sa.select(c.step, c.time, c.loss_sum, c.tokens, c.passes, c.metrics).where(c.model_id == model_id)
        with self._reads.connect() as conn:
            rows = conn.execute(query.order_by(c.id.desc()).limit(limit)).mappings().all()
        return [dict(r) for r in reversed(rows)]

    def fail_pending(self, message: str) -> int:
        """At start-up: requests accepted by a previous server that never ran cannot run now."""
        payload = json.dumps({"error": message, "category": "server"}).encode()
        with self.engine.begin() as conn:
            done = conn.execute(futures.update().where(futures.c.status == "pending").values(
                status="failed", content_type="application/json", result=payload, finished_at=time.time()))
        return done.rowcount

    # ---- checkpoints ----

    def put_checkpoint(self, model_id: str, kind: str, name: str, location: str, expires_at: float | None,
                       size_bytes: int | None, user_metadata: dict) -> None:
        with self.engine.begin() as conn:
            key = (checkpoints.c.model_id == model_id, checkpoints.c.kind == kind, checkpoints.c.name == name)
            conn.execute(checkpoints.delete().where(*key))
            owner = conn.execute(sa.select(models.c.owner).where(models.c.model_id == model_id)).scalar()
            conn.execute(checkpoints.insert().values(
                model_id=model_id, kind=kind, name=name, location=location, created_at=time.time(),
                expires_at=expires_at, size_bytes=size_bytes, user_metadata=user_metadata, owner=owner))

    def checkpoint(self, model_id: str, kind: str, name: str) -> dict | None:
        with self._reads.connect() as conn:
            row = conn.execute(checkpoints.select().where(
                checkpoints.c.model_id == model_id, checkpoints.c.kind == kind, checkpoints.c.name == name,
            )).mappings().first()
        return dict(row) if row else None

    def list_checkpoints(self, model_id: str | None = None, limit: int = 1000, offset: int = 0,
                         owner: str | None = None) -> tuple[list[dict], int]:
        where = _of(checkpoints, owner) + ([] if model_id is None else [checkpoints.c.model_id == model_id])
        with self._reads.connect() as conn:
            total = conn.execute(sa.select(sa.func.count()).select_from(checkpoints).where(*where)).scalar()
            q = checkpoints.select().where(*where).order_by(checkpoints.c.created_at.desc()).limit(limit).offset(offset)
            return [dict(r) for r in conn.execute(q).mappings()], total

    def delete_checkpoint(self, model_id: str, kind: str, name: str) -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(checkpoints.delete().where(
                checkpoints.c.model_id == model_id, checkpoints.c.kind == kind, checkpoints.c.name == name))
        return done.rowcount == 1

    def set_checkpoint_expiry(self, model_id: str, kind: str, name: str, expires_at: float | None) -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(checkpoints.update().where(
                checkpoints.c.model_id == model_id, checkpoints.c.kind == kind, checkpoints.c.name == name,
            ).values(expires_at=expires_at))
        return done.rowcount == 1

    def expired_checkpoints(self, now: float) -> list[dict]:
        with self._reads.connect() as conn:
            q = checkpoints.select().where(checkpoints.c.expires_at.is_not(None), checkpoints.c.expires_at < now)
            return [dict(r) for r in conn.execute(q).mappings()]

    # ---- sampling sessions ----

    def add_sampling_session(self, sampling_session_id: str, session_id: str, base_model: str,
                             model_path: str | None, location: str | None) -> None:
        with self.engine.begin() as conn:
            exists = conn.execute(sa.select(sampling_sessions.c.sampling_session_id).where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)).scalar()
            if exists is None:
                owner = conn.execute(sa.select(sessions.c.owner).where(sessions.c.session_id == session_id)).scalar()
                conn.execute(sampling_sessions.insert().values(
                    sampling_session_id=sampling_session_id, session_id=session_id, base_model=base_model,
                    model_path=model_path, location=location, created_at=time.time(), owner=owner))

    def sampling_session(self, sampling_session_id: str) -> dict | None:
        with self._reads.connect() as conn:
            row = conn.execute(sampling_sessions.select().where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)).mappings().first()
        return dict(row) if row else None

    def sampling_session_ids(self, session_id: str) -> list[str]:
        with self._reads.connect() as conn:
            return list(conn.execute(sa.select(sampling_sessions.c.sampling_session_id).where(
                sampling_sessions.c.session_id == session_id)).scalars())


def _of(table: sa.Table, owner: str | None) -> list:
    """The filter of one tenant's rows (`owner` None: no filter, every tenant's)."""
    return [] if owner is None else [table.c.owner == owner]
