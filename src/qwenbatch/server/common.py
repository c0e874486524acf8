"""What the HTTP routes share: JSON responses, paged lists, and the client's disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

T = TypeVar("T")


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def list_page(records: list, limit: int) -> OrjsonResponse:
    """OpenAI's cursor-paged list of ``records`` (``to_openai()`` each), fetched one past ``limit``
    so that ``has_more`` is known."""
    data = [r.to_openai() for r in records[:limit]]
    page = {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(records) > limit,
    }
    return OrjsonResponse(page)


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests were aborted."""


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone away (the body was read already, so only disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (which aborts its engine
    requests) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected()
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


def sse(payload: BaseModel | dict) -> bytes:
    """One server-sent event carrying JSON."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(exclude_none=True)
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel | dict], request: Request) -> AsyncIterator[bytes]:
    """A serving layer's stream as server-sent events ending in ``[DONE]``. When the client goes away the
    stream is cancelled at once, not at its next chunk, so its engine requests are aborted."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(chunks))
            await asyncio.wait({pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                return  # the client is gone; the finally cancels the stream
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                break
            yield sse(chunk)
        yield SSE_DONE
    finally:
        watcher.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            await chunks.aclose()
