"""Completions: one prompt or a list of them (batched together), echo, logprobs, streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from pydantic import BaseModel

from qwenbatch.engine.async_engine import EngineNotReadyError
from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.outputs import CompletionOutput, RequestOutput
from qwenbatch.serving.base import OpenAIServing, collect, merge, sampling_params, stream_error, usage
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from qwenbatch.tokenizer import Tokenizer


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``."""

    async def create(self, body: CompletionRequest, priority: int = 0) -> Completion | AsyncIterator[BaseModel | dict]:
        """The completion, or for ``stream`` an iterator of chunks (an error body ends a failed one)."""
        prompts = prompt_list(body.prompt)
        inputs = self.admit(body.model, len(prompts) * body.n, param="prompt")
        params = sampling_params(body, body.max_tokens, body.logprobs, inputs.sampling_defaults)
        await self.check_params(body, params, inputs)
        base_id = f"cmpl-{uuid.uuid4().hex}"

        def tokenize(inputs: InputProcessor) -> list[EngineRequest]:
            truncate = body.truncate_prompt_tokens
            return [
                inputs.make_request(f"{base_id}-{i}", p, params, body.stream, priority, truncate)
                for i, p in enumerate(prompts)
            ]

        requests = await self.process(tokenize, param="prompt")
        view = _CompletionView(base_id, self.model_name, inputs.tokenizer, body.n, body.echo, body.logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _stream(requests, self.open_streams(requests), view, include_usage)
        outputs = await collect(self.open_streams(requests))
        choices = [
            view.choice(i, r, c) for i, (r, out) in enumerate(zip(requests, outputs, strict=True)) for c in out.outputs
        ]
        totals = usage(sum(o.num_prompt_tokens for o in outputs), sum(o.num_output_tokens for o in outputs))
        return Completion(id=base_id, created=view.created, model=view.model, choices=choices, usage=totals)


class _CompletionView:
    """Turns engine outputs into completion choices; choice index = prompt index * n + sample index."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer | None, n: int, echo: bool, logprobs: int | None
    ) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.n, self.echo, self.top_logprobs = n, echo, logprobs
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far (for text_offset)

    def prompt_text(self, request: EngineRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        tokenizer = self.tokenizer
        return tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False) if tokenizer else ""

    def choice(self, prompt_index: int, request: EngineRequest, c: CompletionOutput, first: bool = True):
        index = prompt_index * self.n + c.index
        text = self.prompt_text(request) + c.text if self.echo and first else c.text
        start = self.offsets.get(index, len(text) - len(c.text))
        self.offsets[index] = start + len(c.text)
        return CompletionChoice(
            index=index,
            text=text,
            finish_reason=c.finish_reason,
            logprobs=self.logprobs(c, start),
            stop_reason=c.stop_reason,
        )

    def logprobs(self, c: CompletionOutput, offset: int) -> CompletionLogprobs | None:
        if self.top_logprobs is None or c.logprobs is None:
            return None
        tokenizer = self.tokenizer
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, candidates in zip(c.token_ids, c.logprobs, strict=True):
            text = tokenizer.token_text(token_id) if tokenizer else str(token_id)
            top = sorted(candidates.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            out.tokens.append(text)
            out.token_logprobs.append(candidates[token_id])
            out.top_logprobs.append(
                {(tokenizer.token_text(t) if tokenizer else str(t)): lp for t, lp in top} if top else None
            )
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chunk(self, choices: list[CompletionChoice], totals=None) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=totals)


async def _stream(
    requests: list[EngineRequest],
    streams: list[AsyncIterator[RequestOutput]],
    view: _CompletionView,
    include_usage: bool,
) -> AsyncIterator[BaseModel | dict]:
    started: set[int] = set()
    num_output = 0
    async with aclosing(merge(streams)) as merged:  # closing this stream early aborts the requests
        try:
            async for i, output in merged:
                choices = []
                for c in output.outputs:
                    index = i * view.n + c.index
                    choices.append(view.choice(i, requests[i], c, first=index not in started))
                    started.add(index)
                    num_output += len(c.token_ids)
                yield view.chunk(choices)
            if include_usage:
                num_prompt = sum(len(r.prompt_token_ids) for r in requests)
                yield view.chunk([], usage(num_prompt, num_output))
        except (EngineNotReadyError, ValueError) as e:
            yield stream_error(e)
