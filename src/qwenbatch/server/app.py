"""The FastAPI app: lifespan (engine thread), error handlers, auth and limits, and the small routes."""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwenbatch import __version__
from qwenbatch.batch_api.storage import BatchStore, KeyQuota
from qwenbatch.batch_api.worker import BatchWorker
from qwenbatch.config import EngineConfig
from qwenbatch.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineState
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.loader.default_model import cache_root
from qwenbatch.server import batches, files, openai_routes
from qwenbatch.server.common import ClientDisconnected, OrjsonResponse
from qwenbatch.server.guard import GuardMiddleware, is_admin
from qwenbatch.server.metrics import ServerMetrics
from qwenbatch.serving.api import OpenAIServingAPI
from qwenbatch.serving.errors import APIError, engine_error, unavailable, validation_error
from qwenbatch.serving.protocol import ConfigUpdate

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """Server-side settings (the engine's are in EngineConfig)."""

    served_model_names: list[str] = field(default_factory=list)  # default: the --model value
    # With any, every route but /health needs one of them; each key is its own owner of files and batches.
    api_keys: list[str] = field(default_factory=list)
    admin_api_key: str | None = None  # for POST /config (and a key like the others); default: any of api_keys
    max_waiting_seqs: int = 4096  # more waiting than this and new requests get 503 + Retry-After
    max_body_bytes: int = 32 * 2**20  # for every body but an upload to /v1/files
    data_dir: Path | None = None  # the files and batches (storage.BatchStore); default: <cache>/server
    max_file_bytes: int = 200 * 10**6  # largest file uploaded to /v1/files (OpenAI's limit)
    max_batch_requests: int = 50_000  # most requests in one batch's input file (OpenAI's limit)
    # What one key may hold at once (storage.KeyQuota); past them its uploads and new batches get 429.
    max_files_per_key: int = 10_000
    max_storage_per_key: int = 100 * 10**9  # bytes of its files, batch outputs included
    max_open_batches_per_key: int = 100
    batch_api: bool = True  # /v1/files and /v1/batches, and the worker running the batches
    on_fatal: Callable[[BaseException], None] | None = None  # called if the engine cannot load or dies
    request_timeout_s: float = 60.0  # a body must arrive within this (an upload: no stall this long); else 408

    def __post_init__(self) -> None:
        if self.max_waiting_seqs < 1:
            raise ValueError(f"max_waiting_seqs must be >= 1, got {self.max_waiting_seqs}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {self.max_batch_requests}")
        for name in ("max_files_per_key", "max_storage_per_key", "max_open_batches_per_key"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key must be non-empty and have no surrounding whitespace")


def build_app(
    settings: ServerSettings, engine_config: EngineConfig, engine_factory: Callable[[], LLMEngine] | None = None
) -> FastAPI:
    """The app; the engine loads on a background thread once the server runs (``/health`` says when)."""
    names = settings.served_model_names or [engine_config.model]
    metrics = ServerMetrics(names[0], engine_config.resolved_device.type)
    factory = engine_factory or (lambda: LLMEngine(engine_config))
    engine = AsyncEngine(factory, settings.max_waiting_seqs, on_stats=metrics.record, on_fatal=settings.on_fatal)

    worker: BatchWorker | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if worker is not None:
            worker.start()
        yield
        try:
            if worker is not None:
                await worker.stop()
        finally:
            engine.stop()

    app = FastAPI(title="qwenbatch", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving = OpenAIServingAPI(engine, names)
    app.state.metrics = metrics
    app.state.settings = settings
    if settings.batch_api:
        quota = KeyQuota(settings.max_files_per_key, settings.max_storage_per_key, settings.max_open_batches_per_key)
        app.state.store = BatchStore(settings.data_dir or cache_root() / "server", quota)
        # Batch lines in flight: enough to fill every batch slot, few enough to leave the waiting queue
        # (and, with priority, the seats) to interactive requests.
        capacity = max(1, min(2 * engine_config.resolved_max_num_seqs, settings.max_waiting_seqs // 2))
        worker = BatchWorker(serving, app.state.store, capacity, settings.max_body_bytes)
        app.state.batch_worker = worker
        metrics.track_batch_worker(lambda: worker.state)
    # With keys (the admin key counts) every route but /health needs one.
    app.add_middleware(
        GuardMiddleware,
        api_keys=settings.api_keys,
        admin_api_key=settings.admin_api_key,
        body_timeout_s=settings.request_timeout_s,
        max_body_bytes=settings.max_body_bytes,
        max_file_bytes=settings.max_file_bytes,
    )
    _add_error_handlers(app)
    app.include_router(openai_routes.router)
    if settings.batch_api:
        app.include_router(files.router)
        app.include_router(batches.router)
    _add_routes(app, settings, names, metrics)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return OrjsonResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError):
        return OrjsonResponse(validation_error(list(e.errors())).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        body = APIError(e.status_code, str(e.detail), kind).body()
        return OrjsonResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    # The Files and Batch APIs' store: a full disk or a locked database is the server's state, not the
    # request's fault; answer OpenAI-shaped JSON a client can retry on (the store loses nothing stored).
    @app.exception_handler(OSError)
    async def storage_error(_: Request, e: OSError):
        logger.error("storage error: %s", e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            error = APIError(507, "the server's storage is full; retry later", "server_error", code="storage_full")
        else:
            error = APIError(503, f"the server's storage failed ({e.strerror or e}); retry later", "server_error")
        return OrjsonResponse(error.body(), status_code=error.status, headers={"Retry-After": "30"})

    @app.exception_handler(sqlite3.Error)
    async def database_error(_: Request, e: sqlite3.Error):
        logger.error("database error: %s", e)
        error = APIError(503, f"the server's database is unavailable ({e}); retry later", "server_error")
        return OrjsonResponse(error.body(), status_code=503, headers={"Retry-After": "5"})


def _add_routes(app: FastAPI, settings: ServerSettings, names: list[str], metrics: ServerMetrics) -> None:
    serving: OpenAIServingAPI = app.state.serving
    engine = serving.engine
    created = int(time.time())

    @app.get("/health")
    async def health(request: Request):
        state = engine.state
        authenticated = "owner" in request.scope.get("state", {})  # only they see the errors' own words
        worker = getattr(request.app.state, "batch_worker", None)
        if engine.is_healthy:
            body: dict = {"status": "healthy"}
            if worker is not None and worker.state in ("retrying", "stopped"):
                body["batch_worker"] = {"state": worker.state}
                if authenticated:
                    body["batch_worker"]["error"] = worker.last_error
            return OrjsonResponse(body)
        body = {"status": state.value}
        if state is EngineState.DEAD and authenticated:
            body["error"] = str(engine.error)
        return OrjsonResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "qwenbatch",
                "max_model_len": engine.max_model_len,
            }
            for name in names
        ]
        return OrjsonResponse({"object": "list", "data": data})

    @app.get("/version")
    async def version():
        return OrjsonResponse({"version": __version__})

    def effective_config() -> dict:
        try:
            snapshot = engine.config_snapshot()
        except EngineNotReadyError as e:
            raise unavailable(str(e)) from e
        return {**snapshot.as_dict(), "served_model_names": names, "max_waiting_seqs": engine.max_waiting_seqs}

    @app.get("/config")
    async def get_config():
        return OrjsonResponse(effective_config())

    @app.post("/config")
    async def post_config(update: ConfigUpdate, request: Request):
        if not is_admin(request):
            raise APIError(403, "changing the config needs the admin API key", "permission_error")
        try:
            await engine.update_limits(**update.model_dump(exclude_none=True))
        except (EngineNotReadyError, ValueError) as e:
            raise engine_error(e) from e
        return OrjsonResponse(effective_config())

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
