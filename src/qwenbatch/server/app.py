"""The FastAPI app: lifespan (engine thread), error handlers, auth and limits, and the small routes."""

from __future__ import annotations

import dataclasses
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

from qwenbatch.config import EngineConfig
from qwenbatch.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineState
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.loader.default_model import cache_root
from qwenbatch.server import batches, chat, completion, files, rerank
from qwenbatch.server.batch_worker import BatchWorker
from qwenbatch.server.common import APIError, ClientDisconnected, OrjsonResponse, ServerContext, unavailable
from qwenbatch.server.guard import GuardMiddleware, is_admin
from qwenbatch.server.metrics import ServerMetrics
from qwenbatch.server.protocol import ConfigUpdate
from qwenbatch.server.storage import BatchStore, KeyQuota

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
    app.state.ctx = ServerContext(engine, names)
    app.state.metrics = metrics
    app.state.settings = settings
    if settings.batch_api:
        quota = KeyQuota(settings.max_files_per_key, settings.max_storage_per_key, settings.max_open_batches_per_key)
        app.state.store = BatchStore(settings.data_dir or cache_root() / "server", quota)
        # Batch lines in flight: enough to fill every batch slot, few enough to leave the waiting queue
        # (and, with priority, the seats) to interactive requests.
        capacity = max(1, min(2 * engine_config.max_num_seqs, settings.max_waiting_seqs // 2))
        worker = BatchWorker(app, app.state.store, capacity)
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
        internal_token=worker.token if worker else None,
    )
    _add_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completion.router)
    app.include_router(rerank.router)
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
    async def validation_error(_: Request, e: RequestValidationError):
        errors = e.errors() or [{"loc": (), "msg": "invalid request"}]
        # For a union, pydantic reports each branch; a type mismatch of the wrong branch is the least useful.
        first = next((err for err in errors if not str(err.get("type", "")).endswith("_type")), errors[0])
        param = None if first.get("type") == "json_invalid" else _param_path(first.get("loc", ()))
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return OrjsonResponse(APIError(400, message, param=param).body(), status_code=400)

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


# pydantic names the branch of a union it tried ("prompt.str", "content.list[TextPart]"); clients want the field.
_UNION_BRANCHES = {
    "str", "constrained-str", "int", "float", "bool", "dict", "list", "none", "function-after",
    "TextPart", "ChatMessage", "RerankDocument",
}  # fmt: skip


def _param_path(loc: tuple) -> str | None:
    if loc and loc[0] in ("body", "query", "path"):  # where the value came from, not part of its name
        loc = loc[1:]
    parts = [str(p) for p in loc]
    parts = [p for p in parts if p not in _UNION_BRANCHES and "[" not in p]
    return ".".join(parts) or None


def _add_routes(app: FastAPI, settings: ServerSettings, names: list[str], metrics: ServerMetrics) -> None:
    ctx: ServerContext = app.state.ctx
    created = int(time.time())

    @app.get("/health")
    async def health(request: Request):
        state = ctx.engine.state
        authenticated = "owner" in request.scope.get("state", {})  # only they see the errors' own words
        worker = getattr(request.app.state, "batch_worker", None)
        if ctx.engine.is_healthy:
            body: dict = {"status": "healthy"}
            if worker is not None and worker.state in ("retrying", "stopped"):
                body["batch_worker"] = {"state": worker.state}
                if authenticated:
                    body["batch_worker"]["error"] = worker.last_error
            return OrjsonResponse(body)
        body = {"status": state.value}
        if state is EngineState.DEAD and authenticated:
            body["error"] = str(ctx.engine.error)
        return OrjsonResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get("/v1/models")
    async def models():
        max_len = ctx.engine.engine.max_model_len if ctx.engine.engine is not None else None
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "qwenbatch", "max_model_len": max_len}
            for name in names
        ]
        return OrjsonResponse({"object": "list", "data": data})

    @app.get("/config")
    async def get_config():
        return OrjsonResponse(_effective_config(ctx))

    @app.post("/config")
    async def post_config(update: ConfigUpdate, request: Request):
        if not is_admin(request):
            raise APIError(403, "changing the config needs the admin API key", "permission_error")
        try:
            await ctx.engine.update_limits(**update.model_dump(exclude_none=True))
        except EngineNotReadyError as e:
            raise unavailable(str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return OrjsonResponse(_effective_config(ctx))

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _effective_config(ctx: ServerContext) -> dict:
    try:
        engine = ctx.engine.ready_engine()
    except EngineNotReadyError as e:
        raise unavailable(str(e)) from e
    bm = engine.block_manager
    config = dataclasses.asdict(engine.config)
    config.update(
        served_model_names=ctx.served_model_names,
        dtype=str(engine.dtype).removeprefix("torch."),
        max_model_len=engine.max_model_len,
        num_kv_blocks=bm.num_blocks,
        num_kv_tokens=bm.num_blocks * bm.block_size,
        max_waiting_seqs=ctx.engine.max_waiting_seqs,
    )
    return config
