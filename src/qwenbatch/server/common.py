"""What the endpoint modules share: OpenAI-style errors, request -> engine conversion, disconnects, SSE."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from qwenbatch.engine.async_engine import AsyncEngine, EngineNotReadyError, QueueFullError
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.engine.request import EngineRequest
from qwenbatch.outputs import RequestOutput
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.server.protocol import Usage, _SamplingFields
from qwenbatch.server.storage import QuotaExceeded


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


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


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


# storage.KeyQuota's fields -> the serve flags that set them
QUOTA_FLAGS = {
    "max_files": "--max-files-per-key",
    "max_bytes": "--max-storage-per-key",
    "max_open_batches": "--max-open-batches-per-key",
}


def quota_exceeded(e: QuotaExceeded) -> APIError:
    """The 429 for a key at one of its store quotas, naming the flag that sets it."""
    return APIError(429, f"{e} [{QUOTA_FLAGS[e.limit]}]", "rate_limit_error", code="quota_exceeded")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="unavailable", headers={"Retry-After": "1"})


@dataclass
class ServerContext:
    """What every endpoint needs: the engine and the names it answers to."""

    engine: AsyncEngine
    served_model_names: list[str]

    def admit(self, model: str | None, num_seqs: int = 1, param: str | None = None) -> LLMEngine:
        """The engine for a request naming ``model`` that makes ``num_seqs`` sequences: 404 if the model is
        unknown, 503 if loading or the queue has no room for all of them, 400 naming ``param`` if it never can."""
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        try:
            self.engine.check_capacity(num_seqs)
            return self.engine.ready_engine()
        except (EngineNotReadyError, QueueFullError) as e:
            raise unavailable(str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    def open_streams(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue one API request's engine requests, all or none: 503 if the queue has no room for them
        now (other requests took it while these were tokenized), 400 if they can never fit."""
        try:
            return self.engine.open_streams(requests)
        except (EngineNotReadyError, QueueFullError) as e:
            raise unavailable(str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+) ")


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's sampling fields as SamplingParams; 400 naming the field when one is invalid."""
    values = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    try:
        return SamplingParams(**values)
    except ValueError as e:
        message = str(e)
        match = _PARAM_IN_MESSAGE.search(message)
        raise APIError(400, message.replace("SamplingParams.", ""), param=match and match.group(1)) from e


# A token is at least one byte of text in any tokenizer we serve (most are 3-4), so a prompt of more than
# this many bytes per max_model_len token cannot fit: it is refused before tokenizing a byte of it.
MAX_PROMPT_BYTES_PER_TOKEN = 16


def check_text_size(engine: LLMEngine, num_bytes: int, param: str) -> None:
    """400 naming ``param`` when ``num_bytes`` of text could not fit max_model_len, whatever its tokens."""
    limit = engine.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    if num_bytes > limit:
        raise APIError(
            400,
            f"the prompt has {num_bytes} bytes of text: more than {limit} cannot fit "
            f"max_model_len ({engine.max_model_len} tokens)",
            param=param,
        )


def make_request(
    engine: LLMEngine,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    stream: bool,
    truncate_prompt_tokens: int | None,
    param: str,
    priority: int = 0,
) -> EngineRequest:
    """Tokenize (keeping the last ``truncate_prompt_tokens``) and validate; 400 naming ``param``.

    Tokenizing takes time in proportion to the text: call it off the event loop (``run_in_threadpool``).
    """
    if isinstance(prompt, str) and truncate_prompt_tokens is None:
        check_text_size(engine, len(prompt.encode("utf-8", "surrogatepass")), param)
    try:
        if truncate_prompt_tokens is not None:
            if isinstance(prompt, str):
                if engine.tokenizer is None:
                    raise ValueError("this model has no tokenizer (dummy weights): pass prompt token ids")
                prompt = engine.tokenizer.encode(prompt)
            prompt = prompt[-truncate_prompt_tokens:]
        return engine.make_request(request_id, prompt, params, stream=stream, priority=priority)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone away (the body was read already, so only disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def abort_on_disconnect(request: Request, engine: AsyncEngine, request_ids: list[str]) -> asyncio.Future:
    """Abort ``request_ids`` as soon as the client disconnects (cancel the returned watcher when done)."""

    def on_done(watcher: asyncio.Future) -> None:
        if not watcher.cancelled():
            for request_id in request_ids:
                engine.abort(request_id)

    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    watcher.add_done_callback(on_done)
    return watcher


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests were aborted."""


async def collect(streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
    """The final output of each engine stream; aborts them all if the client disconnects first."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        final = None
        async for output in stream:
            final = output
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    gathered = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:
            raise ClientDisconnected()
        outputs = gathered.result()
    except EngineNotReadyError as e:  # the engine died while the request ran
        raise unavailable(str(e)) from e
    except ValueError as e:  # the engine refused the request when it arrived
        raise APIError(400, str(e)) from e
    finally:
        watcher.cancel()
        if gathered.done() and not gathered.cancelled():
            gathered.exception()  # retrieved, so asyncio does not log it again
        gathered.cancel()  # cancels (and so aborts) the streams still running
    if any(o is None or not o.finished for o in outputs):
        raise unavailable("the request was aborted (the server is shutting down)")
    return outputs


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as outputs arrive: ``(stream index, output)``."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def sse(payload: BaseModel | dict) -> bytes:
    """One server-sent event carrying JSON."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(exclude_none=True)
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_error(error: Exception) -> bytes:
    """The event that ends a stream that failed after its 200 was sent (vLLM sends the same shape)."""
    if isinstance(error, EngineNotReadyError):
        return sse(unavailable(str(error)).body())
    return sse(APIError(400, str(error)).body())
