"""What the handlers share: admission through the engine client, tokenizing off the event loop, collecting
and merging engine streams, sampling fields -> SamplingParams, usage."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from qwenbatch.engine.async_engine import AsyncEngine, EngineNotReadyError, QueueFullError
from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.outputs import RequestOutput
from qwenbatch.sampling_params import SamplingDefaults, SamplingParams, StructuredOutputs
from qwenbatch.serving.errors import APIError, engine_error, unavailable
from qwenbatch.serving.protocol import PromptLogprob, PromptLogprobs, Usage, _SamplingFields
from qwenbatch.tokenizer import Tokenizer

T = TypeVar("T")
Streams = list[AsyncIterator[RequestOutput]]


class OpenAIServing:
    """A handler's access to the engine: one engine client and the model names it answers to."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 if a request names a model this server does not answer to."""
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    def admit(self, model: str | None, num_seqs: int = 1, param: str | None = None) -> InputProcessor:
        """The input processor for a request naming ``model`` that makes ``num_seqs`` sequences: 404 if the
        model is unknown, 503 if loading or the queue has no room for them, 400 naming ``param`` if it never can."""
        self.check_model(model)
        try:
            self.engine.check_capacity(num_seqs)
            return self.engine.inputs
        except (EngineNotReadyError, QueueFullError, ValueError) as e:
            raise engine_error(e, param) from e

    async def process(self, work: Callable[[InputProcessor], T], param: str | None = None) -> T:
        """``work(inputs)`` off the event loop (tokenizing takes time in proportion to text); a ValueError
        becomes a 400 naming ``param``."""
        try:
            return await self.engine.process_inputs(work)
        except (EngineNotReadyError, ValueError) as e:
            raise engine_error(e, param) from e

    async def check_params(self, req: _SamplingFields, params: SamplingParams, inputs: InputProcessor) -> None:
        """400 naming the field where the request names a token outside the vocabulary, or where its structured
        output is no grammar (a bad JSON schema, regex or Lark grammar), before anything is tokenized."""
        if outside := inputs.token_ids_outside_vocabulary(params):
            name, message = outside
            raise APIError(400, message, param=name)
        spec = params.structured_outputs
        if spec is not None:
            await self.process(lambda inputs: inputs.check_structured_outputs(spec), param=structured_param(req))

    def open_streams(self, requests: list[EngineRequest]) -> Streams:
        """Queue one API request's engine requests, all or none: 503 if the queue has no room for them
        now (other requests took it while these were tokenized), 400 if they can never fit."""
        try:
            return self.engine.open_streams(requests)
        except (EngineNotReadyError, QueueFullError, ValueError) as e:
            raise engine_error(e) from e


async def collect(streams: Streams) -> list[RequestOutput]:
    """The final output of each engine stream. Cancelling the caller cancels (and so aborts) them all."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        final = None
        async for output in stream:
            final = output
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        outputs = await asyncio.gather(*tasks)
    except EngineNotReadyError as e:  # the engine died while the request ran
        raise unavailable(str(e)) from e
    except ValueError as e:  # the engine refused the request when it arrived
        raise APIError(400, str(e)) from e
    finally:
        for task in tasks:  # after a failure (or the caller's cancellation) the others stop too
            task.cancel()
    if any(o is None or not o.finished for o in outputs):
        raise unavailable("the request was aborted (the server is shutting down)")
    return outputs


async def merge(streams: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as outputs arrive: ``(stream index, output)``. Closing it (or
    cancelling its reader) cancels, and so aborts, the streams still running."""
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


def stream_error(error: Exception) -> dict:
    """The error body that ends a stream which failed after it began (vLLM sends the same shape)."""
    if isinstance(error, EngineNotReadyError):
        return unavailable(str(error)).body()
    return APIError(400, str(error)).body()


def prompt_logprobs_json(output: RequestOutput, tokenizer: Tokenizer | None) -> PromptLogprobs | None:
    """An output's prompt logprobs as vLLM's ``prompt_logprobs`` field: per position the prompt's token (with its
    own rank) and the top ones (ranked by their order), each with its text; None where none were asked for."""
    if output.prompt_logprobs is None or output.prompt_token_ranks is None:
        return None
    entries: PromptLogprobs = [None]
    for entry, rank, token in zip(
        output.prompt_logprobs[1:], output.prompt_token_ranks[1:], output.prompt_token_ids[1:], strict=True
    ):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        entries.append(
            {
                str(t): PromptLogprob(
                    logprob=lp,
                    rank=rank if t == token else i + 1,
                    decoded_token=tokenizer.token_text(t) if tokenizer else str(t),
                )
                for i, (t, lp) in enumerate(ranked)
            }
        )
    return entries


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+) ")


def sampling_params(
    req: _SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: SamplingDefaults,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams, ``defaults`` for those it leaves unset (``prompt_logprobs``:
    where the endpoint asks for more than the field); 400 naming the field when one is invalid."""
    if req.stream and req.prompt_logprobs is not None:  # a chunk has no place for them (vLLM refuses them too)
        raise APIError(
            400, "prompt_logprobs cannot be streamed; send the request with stream false", param="prompt_logprobs"
        )
    values = dict(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
    )
    values["structured_outputs"] = structured_outputs(req)
    try:
        return defaults.params(**values)
    except ValueError as e:
        message = str(e)
        match = _PARAM_IN_MESSAGE.search(message)
        raise APIError(400, message.replace("SamplingParams.", ""), param=match and match.group(1)) from e


def structured_param(req: _SamplingFields) -> str:
    """The field a request sets its structured output with, for errors."""
    return "structured_outputs" if req.structured_outputs is not None and _kinds(req) else "response_format"


def _kinds(req: _SamplingFields) -> dict[str, Any]:
    """What the request's ``structured_outputs`` asks the output to match (none, one or, wrongly, several)."""
    given = req.structured_outputs
    if given is None:
        return {}
    kinds = {"json": given.json_, "regex": given.regex, "choice": given.choice, "grammar": given.grammar}
    return {name: value for name, value in kinds.items() if value is not None} | (
        {"json_object": True} if given.json_object else {}
    )


def structured_outputs(req: _SamplingFields) -> StructuredOutputs | None:
    """What the request's output must match, as vLLM reads it: ``structured_outputs`` (its kind and options), where
    OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with its ``schema``) sets the kind; None for
    plain text. 400 naming the field."""
    kinds, fmt = _kinds(req), req.response_format
    try:
        if fmt is not None and fmt.type != "text":
            if kinds:
                raise ValueError("response_format and a structured_outputs kind cannot both be set")
            if fmt.type == "json_object":
                kinds = {"json_object": True}
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("a json_schema response_format needs json_schema.schema")
            else:
                kinds = {"json": fmt.json_schema.schema_}
        if not kinds:
            return None
        options = req.structured_outputs
        return StructuredOutputs(**kinds, disable_any_whitespace=options is not None and options.disable_any_whitespace)
    except ValueError as e:
        message = str(e).replace("SamplingParams.structured_outputs ", "")
        raise APIError(400, message, param=structured_param(req)) from e
