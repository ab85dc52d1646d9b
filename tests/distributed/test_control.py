"""The control channel in one process: who may join (defect 2) and how process 0 decides a call's outcome
when hosts disagree (defect 4), with scripted workers speaking the protocol over real sockets."""

import contextlib
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import stat
import threading
import time

import pytest

from tests.ports import free_ports
from tx.distributed import auth
from tx.distributed.control import Coordinator, RemoteError, WorkerFailure
from tx.distributed.rpc import Channel
from tx.distributed.worker import connect

SECRET = b"s3cret-for-tests"
HELLO = {"process_id": 1, "pid": 1, "losses": []}


def free_port() -> int:
    return free_ports(1)


def start_coordinator(port: int, **kw) -> dict:
    """Construct a Coordinator in a thread (it blocks until its workers joined): {'c': it} or {'e': error}."""
    box: dict = {}

    def build():
        try:
            box["c"] = Coordinator("127.0.0.1", port, 1, SECRET, **kw)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            box["e"] = e

    box["thread"] = threading.Thread(target=build, daemon=True)
    box["thread"].start()
    return box


def dial(port: int) -> Channel:
    """A raw connection to the control port (retried while the coordinator thread starts listening)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return Channel(socket.create_connection(("127.0.0.1", port), timeout=30))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def closed_by_peer(channel: Channel) -> bool:
    try:
        return channel.recv() is None
    except ConnectionResetError:
        return True


def test_peers_without_the_secret_are_refused_and_the_worker_joins(monkeypatch, caplog):
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="tx.distributed.control")
    port = free_port()
    box = start_coordinator(port, connect_timeout=30)
    silent = dial(port)  # held open meanwhile
    assert silent.recv()["type"] == "challenge"

    peers = {}
    for name in ("no-mac", "oversized", "bad-mac"):
        channel = dial(port)
        assert channel.recv()["type"] == "challenge"
        if name == "no-mac":
            channel.send({"type": "hello", **HELLO, "nonce": "00"})
        elif name == "oversized":
            channel.sock.sendall((1 << 40).to_bytes(8, "big"))
        else:
            nonce = "ab"
            fields = {**HELLO, "type": "hello", "nonce": nonce}
            channel.send({**fields, "mac": "0" * 64})
        peers[name] = closed_by_peer(channel)
        channel.close()
    with pytest.raises(auth.AuthError, match="refused this worker"):
        connect("127.0.0.1", port, 30, lambda: b"wrong", HELLO)
    assert peers == {"no-mac": True, "oversized": True, "bad-mac": True}
    assert "c" not in box  # nobody joined yet

    worker = connect("127.0.0.1", port, 30, lambda: SECRET, HELLO)  # the silent peer does not hold it up
    box["thread"].join(30)
    coordinator = box["c"]
    assert set(coordinator.workers) == {1}
    assert coordinator.address[0] == "127.0.0.1"
    assert closed_by_peer(silent)  # dropped after the handshake timeout
    # After the run started: a second process 1 knowing the secret is refused too; the worker stays.
    with pytest.raises(auth.AuthError):
        connect("127.0.0.1", port, 30, lambda: SECRET, HELLO)
    coordinator.check_alive()
    refusals = [r.getMessage() for r in caplog.records if "refused control connection" in r.getMessage()]
    assert len(refusals) >= 5 and any("wrong or missing secret" in m for m in refusals)
    assert any("not expected" in m for m in refusals)
    worker.close()


def test_the_secret_never_crosses_the_wire_and_the_worker_checks_the_coordinator():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    outcome = {}

    def worker():
        try:
            connect("127.0.0.1", port, 30, lambda: SECRET, HELLO)
            outcome["joined"] = True
        except auth.AuthError as e:
            outcome["error"] = str(e)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    sock, _ = server.accept()
    raw = b""
    channel = Channel(sock)
    nonce = os.urandom(16).hex()
    channel.send({"type": "challenge", "nonce": nonce})
    sock.settimeout(30)
    while not raw.endswith(b"}") or len(raw) < 8 + int.from_bytes(raw[:8], "big"):
        raw += sock.recv(65536)
    hello = json.loads(raw[8:])
    assert SECRET not in raw and SECRET.hex().encode() not in raw
    fields = {k: v for k, v in hello.items() if k != "mac"}
    expected = hmac.new(SECRET, b"worker\0" + nonce.encode() + b"\0" +
                        json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()
    assert hello["mac"] == expected and hello["process_id"] == 1
    channel.send({"type": "welcome", "mac": "f" * 64})  # an impostor coordinator cannot prove the secret
    thread.join(30)
    assert "could not prove" in outcome["error"]
    sock.close()
    server.close()


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="non-loopback host '10.1.2.3' needs a shared secret"):
        auth.resolve_secret(secret=None, secret_file=None, host="10.1.2.3", port=1, coordinator=True)
    (tmp_path / "s").write_text("from-file\n")
    assert auth.resolve_secret(secret=None, secret_file=str(tmp_path / "s"), host="10.1.2.3", port=1,
                               coordinator=False)() == b"from-file"
    with pytest.raises(ValueError, match="not both"):
        auth.resolve_secret(secret="x", secret_file=str(tmp_path / "s"), host="10.1.2.3", port=1, coordinator=True)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        auth.resolve_secret(secret=None, secret_file=str(tmp_path / "empty"), host="h", port=1, coordinator=True)
    monkeypatch.setenv(auth.SECRET_ENV, "from-env")
    assert auth.resolve_secret(secret=None, secret_file=None, host="10.1.2.3", port=1, coordinator=True)() == b"from-env"
    monkeypatch.delenv(auth.SECRET_ENV)
    # Loopback, nothing given: a per-launch secret only this user can read, the same for the workers.
    port = free_port()
    mine = auth.resolve_secret(secret=None, secret_file=None, host="127.0.0.1", port=port, coordinator=True)()
    theirs = auth.resolve_secret(secret=None, secret_file=None, host="localhost", port=port, coordinator=False)
    assert len(mine) == 64 and theirs() == mine
    info = auth.launch_secret_path(port).stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    again = auth.resolve_secret(secret=None, secret_file=None, host="127.0.0.1", port=port, coordinator=True)()
    assert again != mine  # per launch
    auth.launch_secret_path(port).unlink()


# ---- a call's outcome when hosts disagree (defect 4) ----

class ScriptedWorker:
    """Process 1 speaking the protocol: ready (with `view`), then done with the next of `errors` (then
    success) after `delay` s (None: never)."""

    def __init__(self, port: int, errors: tuple = (), delay: float | None = 0.0, view: dict | None = None):
        self.channel = connect("127.0.0.1", port, 30, lambda: SECRET, HELLO)
        self.errors, self.delay, self.view = list(errors), delay, view
        self.stop = threading.Event()
        threading.Thread(target=self.beat, daemon=True).start()
        threading.Thread(target=self.serve, daemon=True).start()

    def beat(self):
        while not self.stop.wait(0.2):
            try:
                self.channel.send({"type": "heartbeat"})
            except OSError:
                return

    def serve(self):
        while (msg := self.channel.recv()) is not None:
            if msg["type"] == "call":
                self.channel.send({"type": "ready", "seq": msg["seq"], "view": self.view})
            elif msg["type"] == "go" and self.delay is not None:
                time.sleep(self.delay)
                error = self.errors.pop(0) if self.errors else None
                self.channel.send({"type": "done", "seq": msg["seq"], "error": error})
            elif msg["type"] == "shutdown":
                break
        self.stop.set()
        self.channel.close()


def pair(errors=(), delay=0.0, heartbeat_timeout=2.0, view=None):
    port = free_port()
    box = start_coordinator(port, heartbeat_timeout=heartbeat_timeout, connect_timeout=30)
    ScriptedWorker(port, errors, delay, view)
    box["thread"].join(30)
    return box["c"]


def blocked():
    threading.Event().wait()  # like a collective whose peer never comes


def test_worker_failing_while_process_zero_is_blocked_is_fatal_within_the_bound():
    coordinator = pair(["OSError: disk gone"], delay=0.2, heartbeat_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="failed on some hosts while process 0 was still running it.*disk gone"):
        coordinator.call("load_checkpoint", {}, run=blocked)
    assert 1.0 < time.monotonic() - start < 1.0 + 1.5  # the report plus the heartbeat bound, not forever
    with pytest.raises(WorkerFailure):  # the run is over
        coordinator.call("forward", {}, run=lambda: 1)
    coordinator.shutdown(timeout=5, reason="test")


def test_the_same_error_a_little_later_on_process_zero_is_not_fatal():
    coordinator = pair(["ValueError: bad input"], delay=0.0, heartbeat_timeout=2.0)

    def slow_fail():
        time.sleep(0.5)  # the worker's report arrives first
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        coordinator.call("forward", {}, run=slow_fail)
    assert coordinator.call("forward", {}, run=lambda: "next") == "next"
    coordinator.shutdown(timeout=5)


def test_worker_failing_after_process_zero_succeeded_is_fatal():
    coordinator = pair(["OSError: late"], delay=0.3)
    with pytest.raises(WorkerFailure, match="succeeded on process 0 but failed on other hosts.*late"):
        coordinator.call("optim_step", {}, run=lambda: "ok")
    coordinator.shutdown(timeout=5)


def test_failure_on_every_host_is_an_ordinary_error_and_the_next_call_works():
    coordinator = pair(["ValueError: model_id 'a' already exists"])

    def fail():
        raise ValueError("model_id 'a' already exists")

    with pytest.raises(ValueError, match="already exists"):
        coordinator.call("create_model", {}, run=fail)
    assert coordinator.call("create_model", {}, run=lambda: 7) == 7
    coordinator.shutdown(timeout=5)


def test_process_zero_failing_alone_is_fatal_within_the_heartbeat_bound():
    coordinator = pair(delay=None, heartbeat_timeout=1.0)  # the worker never finishes (blocked in a collective)

    def fail():
        raise OSError("unreadable on process 0")

    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="failed on process 0 .*unreadable.* did not finish it within 1s"):
        coordinator.call("load_checkpoint", {}, run=fail)
    assert time.monotonic() - start < 3.0


def test_views_that_differ_abort_the_call_on_every_host():
    coordinator = pair(view={"ckpt": "CheckpointNotFound: no checkpoint at ckpt"})
    ran = []
    with pytest.raises(RemoteError, match="process 1: hosts disagree before load_checkpoint, nothing was run: "
                                          "ckpt: process 0 ok, here CheckpointNotFound: no checkpoint at ckpt"):
        coordinator.call("load_checkpoint", {}, run=lambda: ran.append(1), view=lambda: {"ckpt": None})
    assert ran == []
    # The same view on every host (here: the same error) runs the call; each host then fails it alike.
    assert coordinator.call("load_checkpoint", {}, run=lambda: "ran",
                            view=lambda: {"ckpt": "CheckpointNotFound: no checkpoint at ckpt"}) == "ran"
    coordinator.shutdown(timeout=5)


def stop(*_):
    raise SystemExit(143)  # tx.run's SIGTERM handler


@contextlib.contextmanager
def stop_on_sigterm():
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def send_sigterm(*after_s: float) -> None:
    """SIGTERM to this process after each of `after_s` seconds (from a thread: it lands wherever the main
    thread happens to be)."""
    def send():
        for wait in after_s:
            time.sleep(wait)
            os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("phase", ["prepare", "execute"])
def test_a_stop_signal_during_a_call_takes_effect_once_the_call_ended_everywhere(phase):
    """SIGTERM on process 0 mid-call must not leave the workers inside the call (they could not take the
    shutdown message and would exit 1): the stop is raised after every host finished the call, whether it
    came while the workers were asked (before 'go') or while every host ran the call."""
    coordinator = pair(delay=0.6)  # the worker finishes its part 0.6 s after 'go'
    finished = []

    def view():  # process 0 takes its view after the workers got the call, before it decides
        if phase == "prepare":
            signal.raise_signal(signal.SIGTERM)
        return None

    def run():
        if phase == "execute":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.4)
        finished.append("process 0")
        return "ok"

    with stop_on_sigterm():
        start = time.monotonic()
        with pytest.raises(SystemExit) as stopped:
            coordinator.call("forward", {}, run=run, view=view)
        assert stopped.value.code == 143 and finished == ["process 0"] and time.monotonic() - start >= 0.55
        assert signal.getsignal(signal.SIGTERM) is stop  # the usual handler is back
        assert coordinator.call("forward", {}, run=lambda: "next") == "next"  # nothing half-done is left
    coordinator.shutdown(timeout=5)


def test_a_second_stop_signal_does_not_wait_for_the_call():
    coordinator = pair(delay=None)  # the call never ends, on any host
    with stop_on_sigterm():
        send_sigterm(0.2, 0.3)
        start = time.monotonic()
        with pytest.raises(SystemExit):
            coordinator.call("forward", {}, run=blocked)
        assert 0.4 < time.monotonic() - start < 5
        assert signal.getsignal(signal.SIGTERM) is stop
    coordinator.shutdown(timeout=5)
