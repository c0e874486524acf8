"""How the server meets its connections: uvicorn on httptools, with a deadline for each request's headers.

uvicorn bounds an idle keep-alive connection (5 s) and the guard bounds a body's arrival
(``--request-timeout``), but nothing bounds the headers: a client that opens a connection and sends nothing,
or trickles a header line at a time, holds one of ``--max-connections`` slots and its buffer forever. Here a
request's headers must be complete within ``request_timeout_s`` of the connection opening (for its first
request) or of the request's first byte (for the next ones on a keep-alive connection); past that the client
gets a 408 and the connection is closed. Once the headers are in, the deadline is gone: a long generation or a
streamed answer is never cut.
"""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from qwenbatch.server.app import ServerSettings
from qwenbatch.serving.errors import APIError

_TIMEOUT_BODY = orjson.dumps(
    APIError(408, "the request's headers did not arrive in time (--request-timeout)", code="request_timeout").body()
)
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that answers 408 and closes when a request's headers are late."""

    header_timeout_s: float = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()  # a connection that never sends a byte is bounded too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_deadline is None:
            self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._cancel_header_deadline()
        super().on_headers_complete()

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # never write into another request's answer
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def server_config(app, settings: ServerSettings, **uvicorn_options) -> uvicorn.Config:
    """The uvicorn ``Config`` that serves ``app``: ``uvicorn_options`` (host, port, limit_concurrency, ...)
    plus the header deadline of ``settings.request_timeout_s``."""
    deadline = {"header_timeout_s": settings.request_timeout_s}
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), deadline)
    return uvicorn.Config(app, http=protocol, **uvicorn_options)
