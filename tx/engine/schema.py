"""The service database's schema: its tables, its version and the steps that migrate an older database.

A database carries a version row (`tx_schema`): `migrate` creates a new one at `SCHEMA_VERSION`, upgrades an
older one by the steps in `MIGRATIONS` (all in the caller's transaction: all or nothing) and refuses a newer one.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

SCHEMA_VERSION = 4

metadata = sa.MetaData()

schema_info = sa.Table("tx_schema", metadata, sa.Column("version", sa.Integer, nullable=False))

sessions = sa.Table(
    "sessions", metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_heartbeat", sa.Float, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # active | finished | expired
    sa.Column("tags", sa.JSON, nullable=False),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    sa.Column("sdk_version", sa.String(64)),
    sa.Column("display_name", sa.String(256)),
    sa.Column("owner", sa.String(64), index=True),
)

models = sa.Table(
    "models", metadata,
    sa.Column("model_id", sa.String(160), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=False, index=True),
    sa.Column("base_model", sa.String(512), nullable=False),
    sa.Column("lora_config", sa.JSON, nullable=False),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    # creating | ready | failed | unloaded; only `ready` models are in the backend
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_request_time", sa.Float, nullable=False),
    sa.Column("owner", sa.String(64), index=True),
)

futures = sa.Table(
    "futures", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    # identifies a submit so that retries map to the first future, e.g. "train:<model>:<seq>"
    sa.Column("dedup_key", sa.String(256), unique=True),
    sa.Column("model_id", sa.String(160), index=True),
    sa.Column("session_id", sa.String(64), index=True),
    sa.Column("status", sa.String(16), nullable=False),  # pending | done | failed
    sa.Column("content_type", sa.String(64)),
    sa.Column("result", sa.LargeBinary),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, index=True),
    sa.Column("owner", sa.String(64), index=True),
    # the request's span, written with its result (schema 4): when its backend call started, its datums or
    # sequences, input (prompt) tokens and sampled tokens; the console's series and traces after a restart
    sa.Column("started_at", sa.Float),
    sa.Column("size", sa.Integer),
    sa.Column("tokens_in", sa.Integer),
    sa.Column("tokens_out", sa.Integer),
)
SPAN_COLUMNS = ("started_at", "size", "tokens_in", "tokens_out")

# a training run's loss history: one row per optim_step (the forward_backward calls before it added up),
# written with the optim_step's result. A surrogate key: a repeated step number can never fail that write.
train_steps = sa.Table(
    "train_steps", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model_id", sa.String(160), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),  # 1 for the run's first optim_step
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("loss_sum", sa.Float, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=False),
    sa.Column("passes", sa.Integer, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),
)

checkpoints = sa.Table(
    "checkpoints", metadata,
    sa.Column("model_id", sa.String(160), primary_key=True),
    sa.Column("kind", sa.String(32), primary_key=True),  # weights | sampler_weights
    sa.Column("name", sa.String(256), primary_key=True),
    sa.Column("location", sa.String(1024), nullable=False),  # where the files are (local path or URL)
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float),
    sa.Column("size_bytes", sa.BigInteger),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    sa.Column("owner", sa.String(64), index=True),  # the model's owner
    # published: other tenants may read it (load, sample, download, copy); only its owner changes anything
    sa.Column("public", sa.Boolean, nullable=False, server_default=sa.false()),
)

sampling_sessions = sa.Table(
    "sampling_sessions", metadata,
    sa.Column("sampling_session_id", sa.String(160), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=False, index=True),
    sa.Column("base_model", sa.String(512), nullable=False),
    sa.Column("model_path", sa.String(1024)),  # tinker:// path, None = the base model
    sa.Column("location", sa.String(1024)),  # the sampler checkpoint the backend reads
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("owner", sa.String(64), index=True),  # the session's owner
)

OWNED_TABLES = (sessions, models, futures, checkpoints, sampling_sessions)


def _add_owner_columns(conn: Connection) -> None:
    """Schema 1 -> 2: a nullable `owner` on every table (existing rows: no owner, admin only)."""
    for table in OWNED_TABLES:
        conn.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN owner VARCHAR(64)")
        for index in table.indexes:
            if "owner" in index.columns:
                index.create(conn)


def _add_public_column(conn: Connection) -> None:
    """Schema 2 -> 3: checkpoints gain `public` (existing ones stay private)."""
    conn.exec_driver_sql("ALTER TABLE checkpoints ADD COLUMN public BOOLEAN NOT NULL DEFAULT FALSE")


def _add_span_columns(conn: Connection) -> None:
    """Schema 3 -> 4: futures gain their span's columns (existing rows: none); `train_steps` is a new table,
    made by `create_all` before the migrations run."""
    kinds = {"started_at": "FLOAT", "size": "INTEGER", "tokens_in": "INTEGER", "tokens_out": "INTEGER"}
    for name in SPAN_COLUMNS:
        conn.exec_driver_sql(f"ALTER TABLE futures ADD COLUMN {name} {kinds[name]}")
    for index in futures.indexes:
        if "finished_at" in index.columns:
            index.create(conn, checkfirst=True)


# version -> function upgrading a database from `version` to `version + 1`
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _add_owner_columns, 2: _add_public_column, 3: _add_span_columns}


class SchemaError(RuntimeError):
    pass


def migrate(conn: Connection, url: str) -> None:
    """Bring the database at `url` (open in `conn`'s transaction) to `SCHEMA_VERSION`."""
    metadata.create_all(conn, checkfirst=True)
    version = conn.execute(sa.select(schema_info.c.version)).scalar()
    if version is None:
        conn.execute(schema_info.insert().values(version=SCHEMA_VERSION))
        return
    if version > SCHEMA_VERSION:
        raise SchemaError(f"database {url} has schema version {version}; this tx knows up to "
                          f"{SCHEMA_VERSION}: upgrade tx or point --database-url elsewhere")
    while version < SCHEMA_VERSION:
        MIGRATIONS[version](conn)
        version += 1
        conn.execute(schema_info.update().values(version=version))
