"""Who may join the control channel: a shared secret proven by HMAC challenge-response, and where it listens.

Handshake (the secret never crosses the wire; each side proves it knows it over the other's fresh nonce):

1. coordinator -> worker: `challenge` with a random nonce;
2. worker -> coordinator: `hello` (process id, pid, ...) with its own nonce and
   mac = HMAC(secret, "worker" | coordinator nonce | the hello's fields); a wrong or missing mac closes
   the connection, and the refusal is logged;
3. coordinator -> worker: `welcome` with HMAC(secret, "coordinator" | worker nonce), so a worker never runs
   calls from a process that does not know the secret.

The secret comes from --control-secret-file or --control-secret (not both), else TX_CONTROL_SECRET. With
none, a run whose coordinator address is loopback (every process on this machine) uses a per-launch
secret: process 0 writes a random one to a file only this user can read (`launch_secret_path`), which the
workers read once they reach the listener (it is written before the listener opens). Any other run
must be given a secret: nothing else can be derived the same way on every host without sending it.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path
from typing import Callable

from tx.distributed.rpc import Channel

logger = logging.getLogger(__name__)
SECRET_ENV = "TX_CONTROL_SECRET"
HANDSHAKE_BYTES = 64 << 10  # an unauthenticated peer cannot make us read more than this
HANDSHAKE_TIMEOUT_S = 10.0


class AuthError(PermissionError):
    """A peer of the control channel could not prove it knows the shared secret."""


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def launch_secret_path(port: int) -> Path:
    """Per-user, per-port file holding a loopback run's per-launch secret."""
    directory = Path(tempfile.gettempdir()) / f"tx-control-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise AuthError(f"{directory} must be a directory owned by uid {os.getuid()} with mode 0700 "
                        f"(found mode {stat.filemode(info.st_mode)}, uid {info.st_uid}); remove it or pass a secret")
    return directory / f"port-{port}.secret"


def write_launch_secret(port: int) -> bytes:
    path = launch_secret_path(port)
    secret = secrets.token_hex(32).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.replace(tmp, path)
    atexit.register(lambda: path.unlink(missing_ok=True))  # workers read it once, when they join
    return secret


def read_launch_secret(port: int) -> bytes:
    path = launch_secret_path(port)
    try:
        return path.read_bytes().strip()
    except OSError as e:
        raise AuthError(f"cannot read the per-launch control secret {path} ({e}); processes of another user or "
                        "machine need --control-secret-file or TX_CONTROL_SECRET") from None


def resolve_secret(*, secret: str | None, secret_file: str | None, host: str, port: int,
                   coordinator: bool) -> Callable[[], bytes]:
    """The shared secret as a callable (a worker reads a per-launch secret only once the listener is up)."""
    given = None
    if secret and secret_file:
        raise ValueError("pass --control-secret or --control-secret-file, not both")
    if secret_file:
        try:
            given = Path(secret_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--control-secret-file {secret_file!r} cannot be read: {e}") from None
        if not given:
            raise ValueError(f"--control-secret-file {secret_file!r} is empty")
    elif secret:
        given = secret.encode()
    elif os.environ.get(SECRET_ENV):
        given = os.environ[SECRET_ENV].encode()
    if given is not None:
        return lambda: given
    if not is_loopback(host):
        raise ValueError(f"the control channel on non-loopback host {host!r} needs a shared secret: pass "
                         f"--control-secret-file PATH or set {SECRET_ENV} on every process")
    if coordinator:
        created = write_launch_secret(port)
        return lambda: created
    return lambda: read_launch_secret(port)


def _mac(secret: bytes, label: str, nonce: str, fields: dict | None = None) -> str:
    body = json.dumps(fields or {}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, f"{label}\0{nonce}\0{body}".encode(), hashlib.sha256).hexdigest()


def accept_peer(channel: Channel, secret: bytes) -> dict:
    """Coordinator side: the authenticated hello of a new peer, or AuthError. `welcome` admits it."""
    nonce = secrets.token_hex(32)
    channel.send({"type": "challenge", "nonce": nonce})
    try:
        hello = channel.recv(max_bytes=HANDSHAKE_BYTES)
    except (ValueError, OSError) as e:  # oversized, not JSON, timed out
        raise AuthError(f"bad handshake: {e}") from None
    if not isinstance(hello, dict) or hello.get("type") != "hello":
        raise AuthError("no hello message")
    fields = {k: v for k, v in hello.items() if k != "mac"}
    mac = hello.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, "worker", nonce, fields)):
        raise AuthError("wrong or missing secret")
    if not isinstance(hello.get("process_id"), int) or not isinstance(hello.get("nonce"), str):
        raise AuthError("hello without process_id or nonce")
    return hello


def welcome(channel: Channel, secret: bytes, hello: dict) -> None:
    channel.send({"type": "welcome", "mac": _mac(secret, "coordinator", hello["nonce"])})


def join(channel: Channel, secret: bytes, hello: dict) -> None:
    """Worker side: answer the coordinator's challenge and check that it knows the secret too."""
    challenge = channel.recv(max_bytes=HANDSHAKE_BYTES)
    if not challenge or challenge.get("type") != "challenge":
        raise AuthError("the control port did not send a challenge (not a tx coordinator, or an old one)")
    nonce = secrets.token_hex(32)
    fields = {**hello, "type": "hello", "nonce": nonce}
    channel.send({**fields, "mac": _mac(secret, "worker", challenge["nonce"], fields)})
    welcome = channel.recv(max_bytes=HANDSHAKE_BYTES)
    if welcome is None:
        raise AuthError("the coordinator refused this worker (do all processes use the same control secret?)")
    mac = welcome.get("mac")
    if welcome.get("type") != "welcome" or not isinstance(mac, str) or not hmac.compare_digest(
            mac, _mac(secret, "coordinator", nonce)):
        raise AuthError("the coordinator could not prove it knows the control secret")
