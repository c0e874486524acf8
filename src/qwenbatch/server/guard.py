"""ASGI middleware in front of every route: API-key check and request-body size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap streaming responses
and hide client disconnects from the endpoints.
"""

from __future__ import annotations

import hmac

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


async def send_error(send: Send, status: int, message: str, type: str, code: str) -> None:
    body = orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """401 without ``Authorization: Bearer <api_key>`` (when a key is set) on all but /health;
    413 for a body over ``max_body_bytes``, read in full here so the limit holds without a
    Content-Length too."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_keys and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            await send_error(send, 401, "invalid or missing API key", "authentication_error", "invalid_api_key")
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return any(hmac.compare_digest(token.strip(), key) for key in self.api_keys)
        return False

    async def _too_large(self, send: Send, size: int) -> None:
        message = f"the request body has {size} bytes or more; the limit is {self.max_body_bytes}"
        await send_error(send, 413, message, "invalid_request_error", "request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that returns the buffered body once, then waits on the client (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
