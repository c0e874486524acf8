"""OpenAI's Batch API: POST and GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

Batches belong to the API key that made them (guard.owner_of), as files do: another key's batch is
a 404. The work itself is the BatchWorker's (batch_api/worker.py); these routes only read and
write the store and wake the worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request

from qwenbatch.batch_api.storage import BatchRecord, BatchStore, QuotaExceeded
from qwenbatch.batch_api.worker import COMPLETION_WINDOWS, ENDPOINTS
from qwenbatch.server.common import OrjsonResponse, list_page
from qwenbatch.server.files import not_found as file_not_found
from qwenbatch.server.files import quota_exceeded
from qwenbatch.server.guard import owner_of
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import CreateBatchRequest

router = APIRouter()


def _store(request: Request) -> BatchStore:
    return request.app.state.store


def not_found(batch_id: str) -> APIError:
    """The 404 for a batch id that is not there or is not the caller's."""
    return APIError(404, f"No such Batch object: {batch_id}", "not_found_error", param="batch_id")


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, request: Request):
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {list(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        message = f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {body.completion_window!r}"
        raise APIError(400, message, param="completion_window")
    store, owner = _store(request), owner_of(request)
    source = await asyncio.to_thread(store.get_file, owner, body.input_file_id)
    if source is None:
        raise file_not_found(body.input_file_id)
    if source.purpose != "batch":
        message = f"the input file has purpose {source.purpose!r}; a batch needs one uploaded with purpose 'batch'"
        raise APIError(400, message, param="input_file_id")
    limit = request.app.state.settings.max_batch_requests
    path = await asyncio.to_thread(store.file_path, owner, body.input_file_id)
    lines = await asyncio.to_thread(_count_lines, path)
    if lines > limit:
        message = f"the input file has {lines} requests; the limit per batch is {limit}"
        raise APIError(400, message, param="input_file_id", code="batch_too_large")
    expires_at = int(time.time()) + COMPLETION_WINDOWS[body.completion_window]
    try:
        batch = await asyncio.to_thread(
            store.create_batch,
            owner,
            body.endpoint,
            body.input_file_id,
            body.completion_window,
            body.metadata,
            expires_at,
        )
    except QuotaExceeded as e:
        raise quota_exceeded(e) from e
    request.app.state.batch_worker.notify()
    return OrjsonResponse(batch.to_openai())


@router.get("/v1/batches")
async def list_batches(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None):
    try:
        # One more than asked tells whether there are more.
        records = await asyncio.to_thread(_store(request).list_batches, owner_of(request), limit + 1, after)
    except ValueError as e:
        raise APIError(400, str(e), param="after") from e
    return list_page(records, limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str):
    return OrjsonResponse((await _batch(request, batch_id)).to_openai())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    """Move the batch to "cancelling"; the worker stops it and writes what is done (→ "cancelled")."""
    await _batch(request, batch_id)
    batch = await asyncio.to_thread(_store(request).request_cancel, owner_of(request), batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"the batch is {batch.status} and can no longer be cancelled", code="batch_not_cancellable")
    request.app.state.batch_worker.cancel(batch_id)
    return OrjsonResponse(batch.to_openai())


async def _batch(request: Request, batch_id: str) -> BatchRecord:
    batch = await asyncio.to_thread(_store(request).get_batch, owner_of(request), batch_id)
    if batch is None:
        raise not_found(batch_id)
    return batch


def _count_lines(path) -> int:
    """Non-blank lines of a file, counted without parsing them."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())
