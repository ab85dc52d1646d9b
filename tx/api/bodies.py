"""Request bodies: read with size limits (zstd cut off while decompressing), validated as pydantic
models; large bodies are decompressed and decoded in a worker thread, never on the event loop."""

from __future__ import annotations

import json
from typing import Any

import zstandard
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from tx.api.common import ApiError

LARGE_BODY = 1 << 16  # bodies past this many bytes are decoded in a worker thread, not on the event loop


async def read_body(request: Request, max_body_bytes: int, max_decompressed_bytes: int) -> bytes:
    """The request body as sent (zstd decompressed), refused past either limit (cut off while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError(413, f"body of {declared} bytes exceeds the limit of {max_body_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise ApiError(413, f"body exceeds the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = await run_in_threadpool(reader.read, max_decompressed_bytes + 1)
    except zstandard.ZstdError as e:
        raise ApiError(400, f"body is not valid zstd: {e}") from None
    if len(out) > max_decompressed_bytes:
        raise ApiError(413, f"decompressed body exceeds the limit of {max_decompressed_bytes} bytes")
    return out


async def validate(body: bytes, model: type[BaseModel]) -> Any:
    """`body` as a `model`, or a 400 naming each invalid field."""
    try:
        if len(body) > LARGE_BODY:
            return await run_in_threadpool(model.model_validate_json, body)
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise ApiError(400, f"invalid {model.__name__} request: {problems}") from None


def sequence_of(body: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body that names them validly, else None."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
    if isinstance(model_id, str) and type(seq_id) is int and 1 <= seq_id < 2**63:
        return model_id, seq_id
    return None
