"""RPC payloads: a backend method name and its arguments, serialised with pydantic from type hints and
re-hydrated on the workers the same way, so adding a backend method needs no protocol code."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any, Callable, get_type_hints

from pydantic import BaseModel, TypeAdapter

_HEADER = struct.Struct(">Q")  # 8-byte big-endian length, then the JSON bytes


class RpcPayload(BaseModel):
    seq: int
    method: str
    kwargs: dict[str, Any]


def _hints(fn: Callable) -> dict[str, Any]:
    try:
        return get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to plain JSON
        return {}


def encode_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(fn)
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, (Path, os.PathLike)) or type(v).__module__.startswith("cloudpathlib"):
            out[k] = str(v)
        elif k in hints:
            out[k] = TypeAdapter(hints[k]).dump_python(v, mode="json")
        else:
            out[k] = v
    return out


def decode_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(fn)
    return {k: TypeAdapter(hints[k]).validate_python(v) if k in hints else v for k, v in kwargs.items()}


class Channel:
    """Size-prefixed JSON messages over a connected socket; sends are serialised by a lock."""

    def __init__(self, sock):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _read(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self, max_bytes: int | None = None) -> dict | None:
        """The next message, or None when the peer closed the connection. `max_bytes` bounds what an
        unauthenticated peer can make us allocate."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        size = _HEADER.unpack(header)[0]
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"control message of {size} bytes exceeds max_bytes={max_bytes}")
        body = self._read(size)
        return None if body is None else json.loads(body)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
