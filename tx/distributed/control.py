"""The control channel between process 0 (coordinator) and the worker processes.

Peers join through an HMAC challenge-response on a shared secret (`tx.distributed.auth`); the listener
binds to the coordinator address's interface (loopback stays loopback), and a peer that cannot prove the
secret is logged and disconnected without disturbing the workers.

Every call goes through these steps, so that all hosts agree on its outcome:

1. `call`: process 0 sends the payload; each worker re-hydrates and checks its arguments and answers
   `ready` or `error`. Calls that read host-local files (checkpoint loads) also report each host's view
   of those files (`tx.distributed.checks`); hosts that disagree (a file missing or unreadable on one
   host only) fail the call here.
2. `go` or `abort`: only if every worker is ready and the views agree do all hosts execute; otherwise
   nobody does, process 0 raises (`RemoteError`, or its own error), and the next call works normally.
3. `done`: process 0 runs its part in a thread while it polls the workers' reports. A failure on some
   hosts only is fatal (`WorkerFailure`): a worker that fails while process 0 still runs the call leaves
   process 0 blocked in a collective that cannot be cancelled, and a failure after process 0 succeeded
   leaves hosts with different weights or slot tables. The server then exits; a restart starts from
   checkpoints. A call that fails on every host changed nothing (the backend validates before it
   mutates) and is an ordinary error.

A stop signal (SIGTERM, Ctrl-C) that reaches process 0 during a call takes effect once the call has ended
on every host (a second one at once), so the workers are between calls and take the shutdown message.

Workers send heartbeats from a separate thread. A closed connection (a dead worker) is noticed at once,
missing heartbeats (a stopped or wedged host) after `heartbeat_timeout`, and a worker's failure while
process 0 still runs the call after `heartbeat_timeout` at most (the time process 0 gets to fail the
same way); each raises `WorkerFailure` naming the process, and the coordinator refuses further calls.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import socket
import threading
import time
from typing import Any, Callable

from tx.distributed import auth
from tx.distributed.rpc import Channel

logger = logging.getLogger(__name__)
POLL_S = 0.05


class RemoteError(RuntimeError):
    """A call failed on some host before any host ran it; the next call can proceed."""


class WorkerFailure(RuntimeError):
    """A worker died, stopped responding, or the hosts disagree on a call's outcome; the run cannot continue."""


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
            except (OSError, ValueError):
                msg = None
            if msg is None:
                self.closed = True
                return
            self.last_seen = time.monotonic()
            if msg.get("type") != "heartbeat":
                self.inbox.put(msg)


def _describe(errors: dict[int, str]) -> str:
    return "; ".join(f"process {pid}: {e}" for pid, e in sorted(errors.items()))


@contextlib.contextmanager
def _stops_deferred():
    """Hold SIGTERM / SIGINT that arrive inside the block and deliver the first once it has ended.

    A stop that interrupted a call half-way (say after 'go' but before process 0 started its part) would
    leave the workers inside the call, in collectives that never complete, unable to take the shutdown
    message; deferred, it takes effect once every host finished the call. Signals reach only the main
    thread, so elsewhere (the engine's thread under the HTTP server) there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    previous = {s: h for s, h in previous.items() if h is not None}  # None: set outside Python, left alone

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    def hold(signum: int, _frame) -> None:
        held.append(signum)
        if len(held) > 1:  # a second stop does not wait (a call that never ends could otherwise not be stopped)
            restore()
            signal.raise_signal(signum)

    for s in previous:
        signal.signal(s, hold)
    try:
        yield
    finally:
        if len(held) < 2:
            restore()
            if held:
                signal.raise_signal(held[0])  # now the usual handler runs: stop, or the default action


class Coordinator:
    def __init__(self, host: str, port: int, num_workers: int, secret: Callable[[], bytes] | bytes, *,
                 heartbeat_timeout: float = 15.0, connect_timeout: float = 300.0):
        self.heartbeat_timeout = heartbeat_timeout
        self.failure: str | None = None
        self._seq = 0
        self._secret = secret if callable(secret) else (lambda: secret)
        self._expected = set(range(1, num_workers + 1))
        self._joined = threading.Condition()
        self._closing = False
        self.workers: dict[int, _Worker] = {}
        self._server = socket.create_server((host, port), reuse_port=False)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._server.settimeout(0.5)
        threading.Thread(target=self._accept_forever, daemon=True, name="tx-control-accept").start()
        deadline = time.monotonic() + connect_timeout
        with self._joined:
            while len(self.workers) < num_workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._closing = True
                    self._server.close()
                    missing = sorted(self._expected - set(self.workers))
                    raise WorkerFailure(f"worker processes {missing} did not connect within {connect_timeout:.0f}s")
                self._joined.wait(min(left, 1.0))

    # ---- joining ----

    def _accept_forever(self) -> None:
        """Accept for the whole run: unknown peers are refused even after every worker joined."""
        while not self._closing:
            try:
                sock, peer = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            # A handshake per thread: a silent peer cannot hold up the real workers.
            threading.Thread(target=self._admit, args=(sock, peer), daemon=True, name="tx-control-admit").start()

    def _admit(self, sock: socket.socket, peer) -> None:
        sock.settimeout(auth.HANDSHAKE_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(sock)
        try:
            secret = self._secret()
            hello = auth.accept_peer(channel, secret)
            with self._joined:
                pid = hello["process_id"]
                if self._closing or pid not in self._expected or pid in self.workers:
                    raise auth.AuthError(f"process id {pid!r} is not expected (expected {sorted(self._expected)}, "
                                         f"connected {sorted(self.workers)})")
                auth.welcome(channel, secret, hello)
                sock.settimeout(None)
                worker = _Worker(channel, hello)
                self.workers[pid] = worker
                self._joined.notify_all()
        except (auth.AuthError, OSError) as e:
            logger.warning("refused control connection from %s: %s", peer, e)
            channel.close()
            return
        threading.Thread(target=worker.read_forever, daemon=True, name=f"tx-control-{pid}").start()
        logger.info("worker process %d connected from %s (pid %s)", pid, peer, worker.pid)

    # ---- liveness ----

    def _fail(self, message: str) -> None:
        self.failure = self.failure or message
        raise WorkerFailure(self.failure)

    def check_alive(self) -> None:
        if self.failure:
            raise WorkerFailure(self.failure)
        now = time.monotonic()
        for w in self.workers.values():
            if w.closed:
                self._fail(f"worker process {w.process_id} died (control connection closed)")
            if now - w.last_seen > self.heartbeat_timeout:
                self._fail(f"worker process {w.process_id} is unresponsive: no heartbeat for "
                           f"{now - w.last_seen:.1f}s (heartbeat_timeout={self.heartbeat_timeout:.0f}s)")

    def _send_all(self, message: dict) -> None:
        for w in self.workers.values():
            try:
                w.channel.send(message)
            except OSError:
                w.closed = True
        self.check_alive()

    def _gather(self, seq: int, kinds: tuple[str, ...], replies: dict[int, dict]) -> None:
        """Add the replies of `kinds` for `seq` that arrived (no waiting); older messages are dropped."""
        for pid, w in self.workers.items():
            while pid not in replies:
                try:
                    msg = w.inbox.get_nowait()
                except queue.Empty:
                    break
                if msg.get("seq") == seq and msg.get("type") in kinds:
                    replies[pid] = msg
        self.check_alive()

    def _collect(self, seq: int, kinds: tuple[str, ...], replies: dict[int, dict] | None = None,
                 timeout: float | None = None) -> dict[int, dict]:
        """Replies for `seq` from every worker (fewer if `timeout` passes), checking liveness meanwhile."""
        replies = {} if replies is None else replies
        deadline = None if timeout is None else time.monotonic() + timeout
        self._gather(seq, kinds, replies)
        while len(replies) < len(self.workers) and (deadline is None or time.monotonic() < deadline):
            time.sleep(POLL_S)
            self._gather(seq, kinds, replies)
        return replies

    # ---- calls ----

    def call(self, method: str, kwargs: dict, run: Callable[[], Any],
             view: Callable[[], dict | None] | None = None, target: str = "") -> Any:
        """Run `method` on every host: `run` is process 0's part, `view` its view of the call's files,
        `target` the backend (base model) it is meant for ("" = the first one)."""
        with _stops_deferred():
            seq = self.prepare(method, kwargs, view, target)
            return self.execute(seq, method, run)

    def prepare(self, method: str, kwargs: dict, view: Callable[[], dict | None] | None = None,
                target: str = "") -> int:
        """Steps 1-2: broadcast the call; return its seq once every worker is ready and every host sees
        the same files, else abort everywhere and raise."""
        self.check_alive()
        self._seq += 1
        seq = self._seq
        message = {"type": "call", "seq": seq, "method": method, "kwargs": kwargs}
        if target:  # calls of the first backend are sent as before
            message["target"] = target
        self._send_all(message)
        try:
            local = view() if view is not None else None
        except Exception:
            self._collect(seq, ("ready", "error"))
            self._send_all({"type": "abort", "seq": seq})
            raise
        replies = self._collect(seq, ("ready", "error"))
        errors = {pid: r["error"] for pid, r in replies.items() if r["type"] == "error"}
        if not errors:
            errors = _disagreements(method, local, {pid: r.get("view") for pid, r in replies.items()})
        if errors:
            self._send_all({"type": "abort", "seq": seq})
            raise RemoteError(_describe(errors))
        self._send_all({"type": "go", "seq": seq})
        return seq

    def execute(self, seq: int, method: str, run: Callable[[], Any]) -> Any:
        """Step 3: run process 0's part in a thread while polling the workers' reports."""
        box: dict[str, Any] = {}

        def target():
            try:
                box["result"] = run()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        thread = threading.Thread(target=target, daemon=True, name=f"tx-{method}")
        thread.start()
        replies: dict[int, dict] = {}
        failed_at = None
        while thread.is_alive():
            thread.join(POLL_S)
            self._gather(seq, ("done",), replies)
            failed = {pid: r["error"] for pid, r in replies.items() if r.get("error")}
            if failed and failed_at is None:
                failed_at = time.monotonic()
            # Inputs every host rejects fail on each of them, process 0 maybe a little later: it gets the
            # heartbeat bound to fail too; still running after that, it is blocked in a collective.
            if failed_at is not None and thread.is_alive() and time.monotonic() - failed_at > self.heartbeat_timeout:
                self._fail(f"call {method} failed on some hosts while process 0 was still running it "
                           f"{self.heartbeat_timeout:.0f}s later (blocked in a collective that cannot complete?): "
                           f"{_describe(failed)}")
        if "error" not in box:
            # Process 0 finished, so every host took part in the call's collectives: wait for their reports.
            self._collect(seq, ("done",), replies)
            failed = {pid: r["error"] for pid, r in replies.items() if r.get("error")}
            if failed:
                self._fail(f"call {method} succeeded on process 0 but failed on other hosts, which now hold "
                           f"different state: {_describe(failed)}")
            return box["result"]
        # Process 0 failed: the call counts as failed everywhere only if every host reports failing.
        error = box["error"]
        self._collect(seq, ("done",), replies, timeout=self.heartbeat_timeout)
        missing = sorted(set(self.workers) - set(replies))
        if missing:
            self._fail(f"call {method} failed on process 0 ({type(error).__name__}: {error}) and processes "
                       f"{missing} did not finish it within {self.heartbeat_timeout:.0f}s (blocked in a collective?)")
        succeeded = sorted(pid for pid, r in replies.items() if not r.get("error"))
        if succeeded:
            self._fail(f"call {method} failed on process 0 ({type(error).__name__}: {error}) but succeeded on "
                       f"processes {succeeded}, which now hold different state")
        raise error

    def shutdown(self, timeout: float = 30.0, reason: str | None = None) -> None:
        """Tell every worker to stop (with `reason` they exit non-zero), then wait (bounded) for each to
        close its end first: closing ours while their heartbeats are unread would reset the connection
        and could lose the message."""
        self._closing = True
        for w in self.workers.values():
            try:
                w.channel.send({"type": "shutdown", "error": reason})
            except OSError:
                w.closed = True
        deadline = time.monotonic() + timeout
        while not all(w.closed for w in self.workers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for w in self.workers.values():
            w.channel.close()
        self._server.close()


def _disagreements(method: str, local: dict | None, views: dict[int, dict | None]) -> dict[int, str]:
    """Hosts whose view of the call's files differs from process 0's: {process: what differs}."""
    out = {}
    for pid, theirs in views.items():
        if (theirs or {}) == (local or {}):
            continue
        keys = sorted(set(theirs or {}) | set(local or {}))
        diffs = [f"{k}: process 0 {(local or {}).get(k) or 'ok'}, here {(theirs or {}).get(k) or 'ok'}"
                 for k in keys if (theirs or {}).get(k) != (local or {}).get(k)]
        out[pid] = f"hosts disagree before {method}, nothing was run: " + "; ".join(diffs)
    return out
