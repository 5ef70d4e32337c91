"""Slow and greedy clients at the socket: uvicorn's h11 protocol with a deadline for reading each request and a
cap on open connections.

uvicorn bounds the idle time between requests on a kept-alive connection, and nothing else: a client that
sends a request's head one byte every few seconds (slowloris), or a body that never ends, holds its
connection, its buffers and, for a body, a task awaiting it, for as long as it likes. Here the head must
arrive within ``header_timeout_s`` of its first byte (or of the connection, for one that sends nothing), and
the body within ``body_timeout_s`` of the head; past either the client gets a 408 with the OpenAI error body
and the connection is closed. Past ``max_connections`` open connections a new one gets a 503 and is closed at
once, before any of it is read. Once a request is read whole, how long the server takes to answer it is not
bounded here.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.config import ConnectionLimits

log = logging.getLogger("vlmserve.api")


def _raw_response(status: int, reason: str, message: str, kind: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMED_OUT = _raw_response(
    408, "Request Timeout", "the request did not arrive in time", "invalid_request_error", "request_timeout"
)
_TOO_MANY = _raw_response(
    503,
    "Service Unavailable",
    "too many open connections; retry shortly",
    "server_error",
    "too_many_connections",
)


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An ``H11Protocol`` class for ``uvicorn.Config(http=...)`` that enforces ``limits``."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _reading: str | None = None  # "head" or "body" while a deadline runs

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning(
                    "refusing a connection: %d are open (--max-connections)", len(self.connections) - 1
                )
                transport.write(_TOO_MANY)
                transport.close()
                return
            self._arm("head", limits.header_timeout_s)  # NOTE: uvicorn times out none before a first request

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Move the deadline along with what h11 has read of the current request."""
            if self.transport.is_closing():
                return self._disarm()
            state = self.conn.their_state
            if state is h11.IDLE:
                if self.conn.trailing_data[0]:  # part of a head: its deadline runs from its first byte
                    if self._reading != "head":
                        self._arm("head", limits.header_timeout_s)
                else:
                    self._disarm()  # between requests: uvicorn's keep-alive timeout applies
            elif state is h11.SEND_BODY:
                if self._reading != "body":
                    self._arm("body", limits.body_timeout_s)
            else:
                self._disarm()  # read whole (or the connection is ending)

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._reading = what
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._reading = None, None

        def _expired(self) -> None:
            what, self._deadline, self._reading = self._reading, None, None
            if self.transport.is_closing():
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.warning("closing %s: the request's %s did not arrive in time", client, what)
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                if cycle is not None:
                    cycle.disconnected = True  # NOTE: the app, awaiting the body, hears a disconnect
                self.transport.write(_TIMED_OUT)
            self.transport.close()

    return GuardedH11Protocol
