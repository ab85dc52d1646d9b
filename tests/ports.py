"""Loopback ports for the servers tests start, safe with parallel pytest-xdist workers: each worker draws
from its own range below Linux's ephemeral ports (32768 and up), so neither the other worker nor a port
the OS hands out (`bind(0)`, outgoing connections) can take one between the check and the server's bind."""

from __future__ import annotations

import os
import random
import socket

_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_SPAN = 3000
_rng = random.Random(os.getpid())


def free_ports(n: int = 1) -> int:
    """A port p with p .. p + n - 1 free now."""
    base = 20000 + _SPAN * (_WORKER % 4)
    for _ in range(500):
        port = base + _rng.randrange(_SPAN - n)
        try:
            for p in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} free consecutive ports in {base}..{base + _SPAN}")
