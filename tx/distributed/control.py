"""The control channel between process 0 (coordinator) and the worker processes.

Every call goes through three steps, so that all hosts agree on its outcome before and after the
collectives it runs:

1. `call`: process 0 sends the payload; each worker re-hydrates and checks its arguments and answers
   `ready` or `error`.
2. `go` or `abort`: only if every worker is ready do all hosts execute; otherwise nobody does, process 0
   raises `RemoteError`, and the next call works normally.
3. `done`: each worker reports success or its error after executing.

Workers send heartbeats from a separate thread. A closed connection (a dead worker) is noticed at once,
missing heartbeats (a stopped or wedged host) after `heartbeat_timeout`; either raises `WorkerFailure`
naming the process, and the coordinator refuses further calls.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time

from tx.distributed.rpc import Channel

logger = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """A call failed on some host; every host skipped or finished it, so the next call can proceed."""


class WorkerFailure(RuntimeError):
    """A worker died or stopped responding; the run cannot continue."""


class _Worker:
    def __init__(self, channel: Channel, hello: dict):
        self.channel = channel
        self.process_id = hello["process_id"]
        self.pid = hello.get("pid")
        self.hello = hello
        self.inbox: queue.Queue = queue.Queue()
        self.last_seen = time.monotonic()
        self.closed = False

    def read_forever(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except OSError:
                msg = None
            if msg is None:
                self.closed = True
                return
            self.last_seen = time.monotonic()
            if msg.get("type") != "heartbeat":
                self.inbox.put(msg)


class Coordinator:
    def __init__(self, port: int, num_workers: int, *, heartbeat_timeout: float = 15.0, connect_timeout: float = 300.0,
                 host: str = "0.0.0.0"):
        self.heartbeat_timeout = heartbeat_timeout
        self.failure: str | None = None
        self._seq = 0
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(1.0)
        self.workers: dict[int, _Worker] = {}
        deadline = time.monotonic() + connect_timeout
        while len(self.workers) < num_workers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, num_workers + 1)) - set(self.workers))
                raise WorkerFailure(f"worker processes {missing} did not connect within {connect_timeout:.0f}s")
            try:
                sock, _ = self._server.accept()
            except socket.timeout:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = Channel(sock)
            hello = channel.recv()
            if not hello or hello.get("type") != "hello":
                channel.close()
                continue
            worker = _Worker(channel, hello)
            self.workers[worker.process_id] = worker
            threading.Thread(target=worker.read_forever, daemon=True, name=f"tx-control-{worker.process_id}").start()
            logger.info("worker process %d connected (pid %s)", worker.process_id, worker.pid)

    def check_alive(self) -> None:
        if self.failure:
            raise WorkerFailure(self.failure)
        now = time.monotonic()
        for w in self.workers.values():
            if w.closed:
                self.failure = f"worker process {w.process_id} died (control connection closed)"
            elif now - w.last_seen > self.heartbeat_timeout:
                self.failure = (f"worker process {w.process_id} is unresponsive: no heartbeat for "
                                f"{now - w.last_seen:.1f}s (heartbeat_timeout={self.heartbeat_timeout:.0f}s)")
            if self.failure:
                raise WorkerFailure(self.failure)

    def _send_all(self, message: dict) -> None:
        for w in self.workers.values():
            try:
                w.channel.send(message)
            except OSError:
                w.closed = True
        self.check_alive()

    def _collect(self, seq: int, kinds: tuple[str, ...]) -> dict[int, dict]:
        """One reply of one of `kinds` for `seq` from every worker, checking liveness while waiting."""
        replies: dict[int, dict] = {}
        while len(replies) < len(self.workers):
            for pid, w in self.workers.items():
                if pid in replies:
                    continue
                try:
                    msg = w.inbox.get(timeout=0.05)
                except queue.Empty:
                    continue
                if msg.get("seq") == seq and msg.get("type") in kinds:
                    replies[pid] = msg
            self.check_alive()
        return replies

    def prepare(self, method: str, kwargs: dict) -> int:
        """Steps 1-2: broadcast the call; return its seq once every worker is ready, else abort and raise."""
        self.check_alive()
        self._seq += 1
        seq = self._seq
        self._send_all({"type": "call", "seq": seq, "method": method, "kwargs": kwargs})
        replies = self._collect(seq, ("ready", "error"))
        errors = {pid: r["error"] for pid, r in replies.items() if r["type"] == "error"}
        if errors:
            self._send_all({"type": "abort", "seq": seq})
            raise RemoteError("; ".join(f"process {pid}: {e}" for pid, e in sorted(errors.items())))
        self._send_all({"type": "go", "seq": seq})
        return seq

    def finish(self, seq: int) -> None:
        """Step 3: wait until every worker executed call `seq`; raise if any of them failed."""
        replies = self._collect(seq, ("done",))
        errors = {pid: r["error"] for pid, r in replies.items() if r.get("error")}
        if errors:
            raise RemoteError("; ".join(f"process {pid}: {e}" for pid, e in sorted(errors.items())))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Tell every worker to stop, then wait (bounded) for each to close its end first: closing ours
        while their heartbeats are unread would reset the connection and could lose the message."""
        for w in self.workers.values():
            try:
                w.channel.send({"type": "shutdown"})
            except OSError:
                w.closed = True
        deadline = time.monotonic() + timeout
        while not all(w.closed for w in self.workers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for w in self.workers.values():
            w.channel.close()
        self._server.close()
