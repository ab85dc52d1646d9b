"""What the API modules share: the HTTP error type and small JSON helpers."""

from __future__ import annotations

import datetime as dt
import json


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def found(value, what: str):
    """`value`, or a 404 naming what was not found."""
    if value is None:
        raise ApiError(404, f"{what} not found")
    return value


def iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


def str_metadata(meta: dict | None) -> dict[str, str]:
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()}
