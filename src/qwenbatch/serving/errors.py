"""OpenAI-style errors: what a handler raises, and the ``{"error": {...}}`` body every transport sends."""

from __future__ import annotations

from qwenbatch.engine.async_engine import EngineNotReadyError, QueueFullError


class APIError(Exception):
    """An error the client caused or must wait out; rendered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(message: str) -> APIError:
    """The 503 a client retries: loading, the queue full for now, or the engine going away."""
    return APIError(503, message, "service_unavailable", code="unavailable", headers={"Retry-After": "1"})


def engine_error(error: Exception, param: str | None = None) -> APIError:
    """An engine client's refusal as the client should see it: 503 for what passes (not ready, queue full),
    400 naming ``param`` for a request that can never be served (a ValueError)."""
    if isinstance(error, EngineNotReadyError | QueueFullError):
        return unavailable(str(error))
    return APIError(400, str(error), param=param)


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


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for a request body that failed validation (pydantic's ``errors()``), naming the first field."""
    errors = errors or [{"loc": (), "msg": "invalid request"}]
    # For a union, pydantic reports each branch; a type mismatch of the wrong branch is the least useful.
    first = next((err for err in errors if not str(err.get("type", "")).endswith("_type")), errors[0])
    param = None if first.get("type") == "json_invalid" else _param_path(first.get("loc", ()))
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=param)
