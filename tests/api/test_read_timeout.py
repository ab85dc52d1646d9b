"""Slow clients (issue 12, defect 3): uvicorn with tx's read timeout closes slowloris connections (headers
sent a byte at a time, or nothing at all, or a body that stalls) while normal requests keep being served."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from tests.api.server_proc import free_port
from tx.api.timeouts import timed_protocol

READ_TIMEOUT_S = 1.5


@pytest.fixture
def url():
    app = FastAPI()

    @app.get("/ping")
    async def ping():
        return {"pong": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"size": len(await request.body())}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=75, http=timed_protocol(READ_TIMEOUT_S)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(timeout=30)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_slowloris_connections_are_closed_and_others_served(url):
    base, port = url
    head = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200  # never finished
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        socks.append(s)
    silent = socket.create_connection(("127.0.0.1", port))  # connects and sends nothing
    silent.setblocking(False)
    stalled_body = socket.create_connection(("127.0.0.1", port))  # a complete head, then a body that stops
    stalled_body.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    stalled_body.setblocking(False)
    start = time.time()
    closed_at: dict[int, float] = {}
    served = 0
    i = 0
    while len(closed_at) < len(socks) + 2 and time.time() - start < 4 * READ_TIMEOUT_S + 5:
        for n, s in enumerate(socks):
            if n in closed_at:
                continue
            if closed_by_server(s):
                closed_at[n] = time.time() - start
                continue
            try:
                s.send(head[i % len(head):i % len(head) + 1])  # one byte per round
            except OSError:
                closed_at[n] = time.time() - start
        for n, s in ((-1, silent), (-2, stalled_body)):
            if n not in closed_at and closed_by_server(s):
                closed_at[n] = time.time() - start
        assert httpx.get(f"{base}/ping", timeout=5).json() == {"pong": True}  # the server keeps serving
        served += 1
        i += 1
        time.sleep(0.1)
    for s in [*socks, silent, stalled_body]:
        s.close()
    assert len(closed_at) == len(socks) + 2, f"{len(socks) + 2 - len(closed_at)} slow connections still open"
    # closed by the timeout (not before it; a trickling client sent a byte every ~0.1 s)
    assert READ_TIMEOUT_S - 0.1 <= min(closed_at.values()) and max(closed_at.values()) <= 3 * READ_TIMEOUT_S + 2
    assert served >= 5
    r = httpx.post(f"{base}/echo", content=b"x" * 100_000, timeout=5)  # a complete body is still read
    assert r.json() == {"size": 100_000}


def test_keep_alive_connection_outlives_the_read_timeout(url):
    """The read timeout bounds a request's arrival, not the idle time between requests (keep-alive)."""
    base, _ = url
    with httpx.Client(timeout=5) as client:
        first = client.get(f"{base}/ping")
        time.sleep(READ_TIMEOUT_S + 0.5)
        second = client.get(f"{base}/ping")
        assert first.status_code == second.status_code == 200
        port = [r.extensions["network_stream"].get_extra_info("client_addr")[1] for r in (first, second)]
        assert port[0] == port[1]  # the same connection, not a new one
