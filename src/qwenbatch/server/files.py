"""OpenAI's Files API: POST and GET /v1/files, GET and DELETE /v1/files/{id}, GET /v1/files/{id}/content.

Files belong to the API key that uploaded them (guard.owner_of); another key's file is a 404, as if it did
not exist. The rows and bytes live in the app's BatchStore; its blocking calls run on worker threads.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from qwenbatch.batch_api.storage import BatchStore, FileTooLarge, QuotaExceeded
from qwenbatch.server.common import OrjsonResponse, list_page
from qwenbatch.server.guard import owner_of
from qwenbatch.serving.errors import APIError

router = APIRouter()

UPLOAD_PURPOSES = ("batch",)


def _store(request: Request) -> BatchStore:
    return request.app.state.store


# storage.KeyQuota's fields -> the serve flags that set them
QUOTA_FLAGS = {
    "max_files": "--max-files-per-key",
    "max_bytes": "--max-storage-per-key",
    "max_open_batches": "--max-open-batches-per-key",
}


def quota_exceeded(e: QuotaExceeded) -> APIError:
    """The 429 for a key at one of its store quotas, naming the flag that sets it."""
    return APIError(429, f"{e} [{QUOTA_FLAGS[e.limit]}]", "rate_limit_error", code="quota_exceeded")


def not_found(file_id: str) -> APIError:
    """The 404 for a file id that is not there or is not the caller's."""
    return APIError(404, f"No such File object: {file_id}", "not_found_error", param="file_id")


@router.post("/v1/files")
async def create_file(request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]):
    if purpose not in UPLOAD_PURPOSES:
        message = f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}"
        raise APIError(400, message, param="purpose")
    max_bytes = request.app.state.settings.max_file_bytes
    try:
        record = await asyncio.to_thread(
            _store(request).create_file, owner_of(request), file.filename or "file", purpose, file.file, max_bytes
        )
    except FileTooLarge as e:
        raise APIError(413, str(e), param="file", code="request_too_large") from e
    except QuotaExceeded as e:
        raise quota_exceeded(e) from e
    return OrjsonResponse(record.to_openai())


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
):
    try:
        # One more than asked tells whether there are more.
        records = await asyncio.to_thread(
            _store(request).list_files, owner_of(request), purpose, limit + 1, after, order
        )
    except ValueError as e:
        raise APIError(400, str(e), param="after") from e
    return list_page(records, limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    record = await asyncio.to_thread(_store(request).get_file, owner_of(request), file_id)
    if record is None:
        raise not_found(file_id)
    return OrjsonResponse(record.to_openai())


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    path = await asyncio.to_thread(_store(request).file_path, owner_of(request), file_id)
    if path is None:
        raise not_found(file_id)
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    if not await asyncio.to_thread(_store(request).delete_file, owner_of(request), file_id):
        raise not_found(file_id)
    return OrjsonResponse({"id": file_id, "object": "file", "deleted": True})
