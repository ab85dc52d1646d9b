"""The worker loop run by every process except 0: receive a call, check it, execute it when told to."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import jax

from tx import losses
from tx.distributed.backend import method_of
from tx.distributed.rpc import Channel, decode_kwargs

logger = logging.getLogger(__name__)


def connect(host: str, port: int, timeout: float) -> Channel:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Channel(sock)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not reach the coordinator's control port {host}:{port} in {timeout:.0f}s")
            time.sleep(0.5)


def run_worker(host: str, port: int, *, connect_timeout: float = 300.0, heartbeat_interval: float = 1.0) -> int:
    """Serve calls from process 0 until it says shutdown (returns 0) or disappears (returns 1)."""
    process_id = jax.process_index()
    channel = connect(host, port, connect_timeout)
    channel.send({"type": "hello", "process_id": process_id, "pid": os.getpid(), "losses": list(losses.names())})
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(heartbeat_interval):
            try:
                channel.send({"type": "heartbeat"})
            except OSError:
                return

    threading.Thread(target=heartbeat, daemon=True, name="tx-heartbeat").start()
    backend = None
    status = 1
    try:
        while True:
            msg = channel.recv()
            if msg is None:
                logger.error("coordinator closed the control connection")
                break
            if msg["type"] == "shutdown":
                status = 0
                break
            if msg["type"] != "call":
                continue
            seq, method = msg["seq"], msg["method"]
            try:
                kwargs = decode_kwargs(method_of(method), msg["kwargs"])
                if method == "debug_fail" and kwargs.get("phase") == "prepare" and process_id in kwargs["process_ids"]:
                    raise RuntimeError(kwargs["message"])
            except Exception as e:  # noqa: BLE001 - reported to process 0, which aborts the call everywhere
                channel.send({"type": "error", "seq": seq, "error": f"{type(e).__name__}: {e}"})
                continue
            channel.send({"type": "ready", "seq": seq})
            decision = channel.recv()
            if decision is None:
                break
            if decision["type"] != "go":
                continue
            error = None
            try:
                if method == "__init__":
                    from tx.backends.jax import JaxBackend

                    backend = JaxBackend(**kwargs)
                else:
                    getattr(backend, method)(**kwargs)
            except Exception as e:  # noqa: BLE001 - reported; the worker keeps serving
                logger.exception("call %s failed", method)
                error = f"{type(e).__name__}: {e}"
            channel.send({"type": "done", "seq": seq, "error": error})
    finally:
        stop.set()
        channel.close()
    return status
