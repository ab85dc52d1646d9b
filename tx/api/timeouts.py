"""uvicorn's HTTP/1.1 protocol with a read timeout, so slow clients cannot hold connections forever.

uvicorn (0.54) has no timeout while a request arrives: `timeout_keep_alive` only covers the idle time
between requests and is cancelled by the first byte received, so a client sending its headers a byte at
a time (slowloris), or opening a connection and sending nothing, keeps it, and its file descriptor, for
as long as it likes. ASGI middleware cannot help: the app only sees complete request heads.

Here, as nginx's client_header_timeout and client_body_timeout do: a request's head must be complete
within `read_timeout_s` of its first byte (of the connection's opening, for the first request), and its
body may not pause longer than `read_timeout_s` between reads. Pauses the server makes itself (reading
suspended while the app has not consumed the body yet) do not count. On expiry the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class TimedH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # a request head is arriving: its deadline runs from its first byte
            if self._read_deadline is None:
                self._arm()
        elif state is h11.SEND_BODY:  # the body: each read restarts the clock (a pause, not a total)
            self._arm()
        else:  # the request is complete (or the connection is closing): nothing more to wait for
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server stopped reading, not the client: wait again
            self._arm()
            return
        logger.info("closing connection from %s: request not received within %.0f s", self.client,
                    self.read_timeout_s)
        self.transport.close()


def timed_protocol(read_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...), with this timeout."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout_s": read_timeout_s})
