"""What the API modules share: the HTTP error type, tenants, listing bounds, checkpoint keys and small JSON
helpers."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tx.engine import paths

MAX_LIMIT = 1000

io = run_in_threadpool  # store and engine calls block: routes run them in a worker thread, off the event loop


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def found(value, what: str):
    """`value`, or a 404 naming what was not found."""
    if value is None:
        raise ApiError(404, f"{what} not found")
    return value


@dataclass(frozen=True)
class Tenant:
    """Who is calling: `id` is the SHA-256 hex digest of the API key (what the store keeps as `owner`)."""

    id: str
    admin: bool = False

    @staticmethod
    def of_key(key: str, admin: bool = False) -> Tenant:
        return Tenant(hashlib.sha256(key.encode()).hexdigest(), admin)

    @property
    def filter(self) -> str | None:
        """The store's `owner` filter for listings: None (all tenants) for an admin."""
        return None if self.admin else self.id

    def sees(self, owner: str | None) -> bool:
        return self.admin or owner == self.id


def tenant(request: Request) -> Tenant:
    return request.state.tenant


def admin_only(who: Tenant, what: str, instead: str = "") -> None:
    """A 403 unless `who` holds an admin key: server-wide numbers are not shown to tenants (strangers)."""
    if not who.admin:
        raise ApiError(403, f"{what} needs an admin API key (--admin-api-key / TX_ADMIN_API_KEYS); this key is a "
                            f"tenant's{'; ' + instead if instead else ''}")


def owned(row, who: Tenant, what: str):
    """`row` if it exists and `who` may see it, else the same 404 as for an unknown id (ids do not leak)."""
    owner = None if row is None else (row["owner"] if isinstance(row, dict) else row.owner)
    return found(row if row is not None and who.sees(owner) else None, what)


def readable(row, who: Tenant, what: str):
    """Like `owned`, but a published checkpoint (`public`) is readable by every tenant."""
    if row is not None and row.get("public"):
        return row
    return owned(row, who, what)


def page(limit: int, offset: int) -> tuple[int, int]:
    """Listing bounds, checked: 1 <= limit <= MAX_LIMIT, offset >= 0."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit {limit} must be between 1 and {MAX_LIMIT}")
    if offset < 0:
        raise ApiError(400, f"offset {offset} must be >= 0")
    return limit, offset


def checkpoint_key(run_id: str, kind: str, name: str) -> tuple[str, str, str]:
    """The store key (model_id, kind, name) of a checkpoint named in a REST path, checked like a tinker path."""
    return paths.parse_tinker_path(paths.tinker_path(run_id, kind, name), "checkpoint")


def iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


def str_metadata(meta: dict | None) -> dict[str, str]:
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()}
