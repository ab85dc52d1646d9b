"""The worker loop run by every process except 0: receive a call, check it, execute it when told to."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from tx import losses, ranks
from tx.distributed import auth, checks
from tx.distributed.backend import method_of
from tx.distributed.rpc import Channel, decode_kwargs

logger = logging.getLogger(__name__)


def connect(host: str, port: int, timeout: float, secret: Callable[[], bytes], hello: dict) -> Channel:
    """Reach the coordinator's control port and pass its handshake (AuthError if secrets differ)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=auth.HANDSHAKE_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not reach the coordinator's control port {host}:{port} in {timeout:.0f}s")
            time.sleep(0.5)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(sock)
        try:
            auth.join(channel, secret(), hello)
        except BaseException:
            channel.close()
            raise
        sock.settimeout(None)
        return channel


def run_worker(host: str, port: int, secret: Callable[[], bytes], *, connect_timeout: float = 300.0,
               heartbeat_interval: float = 1.0) -> int:
    """Serve calls from process 0 until it says shutdown (returns 0, or 1 if it stops the run for a
    failure) or disappears (returns 1)."""
    process_id = ranks.launch_rank()  # the coordinator expects launch ranks 1..N-1 (tx.ranks)
    channel = connect(host, port, connect_timeout, secret,
                      {"process_id": process_id, "pid": os.getpid(), "losses": list(losses.names())})
    stop = threading.Event()
    busy = threading.Event()  # set while a call executes (the main thread may be blocked in a collective)

    def heartbeat():
        while not stop.wait(heartbeat_interval):
            try:
                channel.send({"type": "heartbeat"})
            except OSError:
                if busy.is_set():
                    # Process 0 is gone and our call cannot finish: its collectives wait for it forever.
                    logger.error("coordinator closed the control connection during a call; exiting")
                    logging.shutdown()
                    os._exit(1)
                return

    threading.Thread(target=heartbeat, daemon=True, name="tx-heartbeat").start()
    backends = {}  # target (base model name; "" = the first) -> JaxBackend
    status = 1
    try:
        while True:
            msg = channel.recv()
            if msg is None:
                logger.error("coordinator closed the control connection")
                break
            if msg["type"] == "shutdown":
                status = _shutdown_status(msg)
                break
            if msg["type"] != "call":
                continue
            seq, method, target = msg["seq"], msg["method"], msg.get("target", "")
            backend = backends.get(target)
            try:
                if backend is None and method != "__init__":
                    raise KeyError(f"no backend {target!r} on process {process_id}: it was never created")
                kwargs = decode_kwargs(method_of(method), msg["kwargs"])
                if method == "debug_fail" and kwargs.get("phase") == "prepare" and process_id in kwargs["process_ids"]:
                    raise RuntimeError(kwargs["message"])
                view = checks.view(method, backend, kwargs)
            except Exception as e:  # noqa: BLE001 - reported to process 0, which aborts the call everywhere
                channel.send({"type": "error", "seq": seq, "error": f"{type(e).__name__}: {e}"})
                continue
            channel.send({"type": "ready", "seq": seq, "view": view})
            decision = channel.recv()
            if decision is None:
                break
            if decision["type"] == "shutdown":  # process 0 stopped before deciding on this call
                status = _shutdown_status(decision)
                break
            if decision["type"] != "go":
                continue
            error = None
            busy.set()
            try:
                checks.injected_failure(method, process_id)
                if method == "__init__":
                    from tx.backends.full import backend_class

                    backends[target] = backend_class(kwargs["config"])(**kwargs)
                    logger.info("backend %r ready: base model %s", target, kwargs["base_model"])
                else:
                    getattr(backend, method)(**kwargs)
            except Exception as e:  # noqa: BLE001 - reported; process 0 decides whether the run can go on
                logger.exception("call %s failed", method)
                error = f"{type(e).__name__}: {e}"
            finally:
                busy.clear()
            channel.send({"type": "done", "seq": seq, "error": error})
    finally:
        stop.set()
        channel.close()
    return status


def _shutdown_status(msg: dict) -> int:
    """Exit status for process 0's shutdown message: 1 when it stopped the run for a failure."""
    if msg.get("error"):
        logger.error("process 0 stopped the run: %s", msg["error"])
        return 1
    return 0
