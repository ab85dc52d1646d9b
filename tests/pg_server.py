"""Throwaway PostgreSQL servers for tests: a real postmaster on 127.0.0.1, data dir under a temp dir."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_TOOLS = ("initdb", "postgres", "pg_ctl")
DB_NAME = "tx_test"


class PostgresUnavailable(RuntimeError):
    """No usable PostgreSQL binaries; tests call tests.require.skip_or_fail(str(exc)) (a failure in CI)."""


def _has_tools(d: Path) -> bool:
    return all(os.access(d / t, os.X_OK) for t in _TOOLS)


def find_postgres_bin() -> Path | None:
    """Directory holding initdb, postgres and pg_ctl, or None."""
    candidates: list[Path] = []
    if found := shutil.which("pg_ctl"):
        # Resolve: /usr/local/bin/pg_ctl may be a lone symlink into /usr/lib/postgresql/N/bin.
        candidates.append(Path(found).resolve().parent)
    # Debian/Ubuntu keep server binaries off PATH; prefer the newest major version.
    versions = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if Path(p).parent.name.isdigit()]
    candidates += sorted(versions, key=lambda p: int(p.parent.name), reverse=True)
    # The `pgserver` wheel bundles a full build; find_spec locates it without importing (its import has side effects).
    if (spec := importlib.util.find_spec("pgserver")) and spec.origin:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    return next((d for d in candidates if _has_tools(d)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unprivileged_user() -> pwd.struct_passwd:
    # postgres refuses to run as root; 'nobody' exists on Debian, else make a dedicated system user.
    for name in ("nobody", "txpg"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(["useradd", "--system", "--no-create-home", "txpg"], check=True)
    return pwd.getpwnam("txpg")


def _allow_traverse(path: Path) -> None:
    # The dropped user must reach the data dir and binaries, but pytest's basetemp (and /root) are 0700:
    # add search-only permission (o+x, not listing) on root-owned ancestors that lack it.
    for p in [path, *path.parents]:
        st = p.stat()
        if st.st_uid == 0 and not st.st_mode & stat.S_IXOTH:
            p.chmod(st.st_mode | stat.S_IXOTH)


@contextlib.contextmanager
def postgres_server(tmp_dir: Path) -> Iterator[str]:
    """Start a fresh server, create database `tx_test`, yield its `postgresql+psycopg://` URL, then stop it."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise PostgresUnavailable(
            "PostgreSQL binaries not found (looked on PATH, in /usr/lib/postgresql/*/bin and the pgserver package); "
            "install the `postgresql` apt package or `pip install pgserver` (in the dev extra)"
        )
    Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pg-", dir=tmp_dir))  # unique, so one tmp_dir can host several servers
    data, log = root / "data", root / "server.log"
    run_as: dict[str, Any] = {}
    if os.geteuid() == 0:
        user = _unprivileged_user()
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        os.chown(root, user.pw_uid, user.pw_gid)
        _allow_traverse(root)
        _allow_traverse(bin_dir)

    def pg(*args: str) -> subprocess.CompletedProcess[str]:
        if run_as:  # something (pytest's tmp-dir handling in another process) may reset the modes meanwhile
            _allow_traverse(root)
        # cwd=root: the dropped user may not be able to stat the caller's cwd.
        return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=root, capture_output=True, text=True, **run_as)

    def check(proc: subprocess.CompletedProcess[str]) -> None:
        if proc.returncode != 0:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"{proc.args} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}{server_log}")

    # Trust auth on loopback only; --no-sync and fsync=off because test data is disposable.
    check(pg("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"))
    with open(data / "postgresql.conf", "a") as conf:
        # No unix socket: the socket path length limit (~107 chars) is easy to exceed under pytest tmp dirs.
        conf.write("listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\n")
        conf.write("fsync = off\nfull_page_writes = off\nsynchronous_commit = off\n")
    for _ in range(3):  # the free port can be taken between probing and binding; retry with another
        port = _free_port()
        started = pg("pg_ctl", "start", "-w", "-t", "60", "-D", str(data), "-l", str(log), "-o", f"-p {port}")
        if started.returncode == 0:
            break
    check(started)
    try:
        import psycopg  # imported here so that merely importing this module never needs the driver

        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DB_NAME}")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{DB_NAME}"
    finally:
        check(pg("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(data)))
