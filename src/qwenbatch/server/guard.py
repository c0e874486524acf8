"""ASGI middleware in front of every route: API-key check, caller identity and request-body size limits.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap streaming responses
and hide client disconnects from the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import Sequence

import orjson
from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})
UPLOAD_PATHS = frozenset({"/v1/files"})  # POSTs here are streamed through, held to max_file_bytes
# Room for the multipart framing and the small form fields around the file; the route holds the file
# itself to max_file_bytes exactly.
MULTIPART_SLACK_BYTES = 64 * 2**10
# A refused body is read and dropped up to this many bytes, so the client gets to read the 413.
DRAIN_MAX_BYTES = 64 * 2**20


def owner_id(api_key: str) -> str:
    """The identity rows made with ``api_key`` are stored under: a hash prefix, so no key is ever stored."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def owner_of(request: Request) -> str:
    """The identity the guard authenticated this request as ("" on a server without API keys)."""
    return request.scope["state"]["owner"]


def is_admin(request: Request) -> bool:
    """True for the admin key's holder; on a server without an admin key, for every authenticated caller."""
    return request.scope.get("state", {}).get("admin", False)


def allowed_priority(request: Request, priority: int) -> int:
    """A priority better than the default (negative) is an admin's privilege: anyone else's becomes 0,
    so one key cannot jump the queue of every other."""
    return priority if priority >= 0 or is_admin(request) else 0


async def send_error(send: Send, status: int, message: str, type: str, code: str) -> None:
    body = orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """401 without ``Authorization: Bearer <one of api_keys or the admin key>`` (when there are keys) on all
    but /health, else the caller's identity in ``scope["state"]["owner"]`` (see ``owner_of``) and whether it
    is an admin in ``scope["state"]["admin"]``; 400 for several Authorization headers; 413 for a body over
    ``max_body_bytes``, read in full here so the limit holds without a Content-Length too. An upload to
    /v1/files is instead passed through as it arrives and cut off past ``max_file_bytes``."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Sequence[str],
        max_body_bytes: int,
        max_file_bytes: int,
        admin_api_key: str | None = None,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.app = app
        # The admin key is a key like the others too (a server may have it alone).
        every_key = [*api_keys, *([admin_api_key] if admin_api_key else [])]
        self.keys = tuple((key.encode(), owner_id(key)) for key in every_key)
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes
        # A client that trickles its body (a byte a second) would hold a connection and its buffer forever:
        # a JSON body must arrive whole within this, an upload must not stall this long between chunks.
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            message = "send one Authorization header, not several"
            await send_error(send, 400, message, "invalid_request_error", "duplicate_authorization")
            return
        owner = self._owner(scope)
        if owner is None and scope["path"] not in OPEN_PATHS:
            await send_error(send, 401, "invalid or missing API key", "authentication_error", "invalid_api_key")
            return
        if owner is not None:
            state = scope.setdefault("state", {})
            state["owner"] = owner
            state["admin"] = self._is_admin_token(scope)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] in UPLOAD_PATHS:
            await self._pass_upload(scope, receive, send)
        else:
            await self._pass_buffered(scope, receive, send)

    def _is_admin_token(self, scope: Scope) -> bool:
        if self.admin_key is None:
            return True  # no admin key: every authenticated caller may, as with one key before there were several
        return hmac.compare_digest(_bearer_token(scope), self.admin_key)

    def _owner(self, scope: Scope) -> str | None:
        """The identity of the request's key; "" when there are no keys; None when it has no valid key."""
        token = _bearer_token(scope)
        if not self.keys:
            return ""
        if not token:
            return None
        return next((owner for key, owner in self.keys if hmac.compare_digest(token, key)), None)

    async def _pass_buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._drain(receive, declared)
            await self._body_too_large(send, declared)
            return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        if message.get("more_body", False):
                            await self._drain(receive, declared)
                        await self._body_too_large(send, size)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._body_too_slow(send)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _pass_upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the body to the app (which spools the file to disk); past the limit, answer 413 here and
        let the app see a disconnect, dropping whatever it sends after. Cut off here rather than in the
        route, because the form is parsed, and the file spooled in full, before the route runs."""
        limit = self.max_file_bytes + MULTIPART_SLACK_BYTES
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._upload_too_large(send, declared)
            return
        size, cut_off = 0, False

        async def counting_receive() -> Message:
            nonlocal size, cut_off
            if cut_off:
                return {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                cut_off = True
                await self._body_too_slow(send)
                return {"type": "http.disconnect"}
            size += len(message.get("body", b""))
            if size > limit:
                cut_off = True
                await self._upload_too_large(send, size)
                return {"type": "http.disconnect"}
            return message

        async def send_unless_cut_off(message: Message) -> None:
            if not cut_off:
                await send(message)

        await self.app(scope, counting_receive, send_unless_cut_off)

    async def _drain(self, receive: Receive, declared: int | None) -> None:
        """Read and drop the rest of a refused body (up to DRAIN_MAX_BYTES, within the body timeout) before
        answering, so a client still sending it reads the 413 instead of a reset connection (urllib; uvicorn
        delivers no body once the response is complete). A declared body over the bound is not waited for."""
        if declared is not None and declared > DRAIN_MAX_BYTES:
            return
        drained = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.body_timeout_s):
                while drained <= DRAIN_MAX_BYTES:
                    message = await receive()
                    drained += len(message.get("body", b""))
                    if message["type"] == "http.disconnect" or not message.get("more_body", False):
                        return

    async def _body_too_slow(self, send: Send) -> None:
        message = f"the request body did not arrive within {self.body_timeout_s:g} s"
        await send_error(send, 408, message, "invalid_request_error", "request_timeout")

    async def _body_too_large(self, send: Send, size: int) -> None:
        message = f"the request body has {size} bytes or more; the limit is {self.max_body_bytes}"
        await send_error(send, 413, message, "invalid_request_error", "request_too_large")

    async def _upload_too_large(self, send: Send, size: int) -> None:
        message = f"the upload has {size} bytes or more; the limit for a file is {self.max_file_bytes} bytes"
        await send_error(send, 413, message, "invalid_request_error", "request_too_large")


def _bearer_token(scope: Scope) -> bytes:
    """The token of the request's ``Authorization: Bearer`` header, or b""."""
    value = next((v for name, v in scope["headers"] if name == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


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
