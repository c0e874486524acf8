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
from qwenbatch.serving.base import (
    OpenAIServing,
    collect,
    merge,
    prompt_logprobs_json,
    sampling_params,
    stream_error,
    usage,
)
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
        echo_only = body.echo and body.max_tokens == 0  # OpenAI's: the prompt back, nothing generated
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens"
            )
        # echo with logprobs: the prompt tokens' logprobs come first (vLLM's), as an evaluation harness reads them.
        prompt_logprobs = None
        if body.echo and body.logprobs is not None:  # the echoed prompt's top ones as many as the output's
            prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        max_tokens = 1 if echo_only else body.max_tokens  # the one token that ends the prompt's step is dropped
        params = sampling_params(body, max_tokens, body.logprobs, inputs.sampling_defaults, prompt_logprobs)
        await self.check_params(body, params, inputs)
        base_id = f"cmpl-{uuid.uuid4().hex}"

        def tokenize(inputs: InputProcessor) -> list[EngineRequest]:
            truncate = body.truncate_prompt_tokens
            return [
                inputs.make_request(f"{base_id}-{i}", p, params, body.stream, priority, truncate)
                for i, p in enumerate(prompts)
            ]

        requests = await self.process(tokenize, param="prompt")
        view = _CompletionView(base_id, self.model_name, inputs.tokenizer, body, echo_only)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _stream(requests, self.open_streams(requests), view, include_usage)
        outputs = await collect(self.open_streams(requests))
        choices = []
        for i, (request, output) in enumerate(zip(requests, outputs, strict=True)):
            view.keep_prompt_logprobs(i, output)
            field = await self.process(lambda _: prompt_logprobs_json(output, inputs.tokenizer))  # noqa: B023
            for c in output.outputs:
                choices.append(view.choice(i, request, c).model_copy(update={"prompt_logprobs": field}))
        num_output = 0 if echo_only else sum(o.num_output_tokens for o in outputs)
        totals = usage(sum(o.num_prompt_tokens for o in outputs), num_output)
        return Completion(id=base_id, created=view.created, model=view.model, choices=choices, usage=totals)


class _CompletionView:
    """Turns engine outputs into completion choices; choice index = prompt index * n + sample index."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer | None, body: CompletionRequest, echo_only: bool
    ) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.n, self.echo, self.top_logprobs, self.echo_only = body.n, body.echo, body.logprobs, echo_only
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far (for text_offset)
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}  # per prompt index, once they came

    def keep_prompt_logprobs(self, prompt_index: int, output: RequestOutput) -> None:
        """Hold a prompt's logprobs (a stream's first output of that prompt carries them) for its choices' echoes."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs

    def prompt_text(self, request: EngineRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        tokenizer = self.tokenizer
        return tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False) if tokenizer else ""

    def choice(self, prompt_index: int, request: EngineRequest, c: CompletionOutput, first: bool = True):
        index = prompt_index * self.n + c.index
        token_ids, entries, text = (c.token_ids, c.logprobs, c.text) if not self.echo_only else ([], [], "")
        prompt = self.prompt_text(request) if self.echo and first else ""
        start = self.offsets.get(index, len(prompt))
        self.offsets[index] = start + len(text)
        logprobs = None
        if self.top_logprobs is not None and entries is not None:
            logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            if self.echo and first:
                self._add_logprobs(logprobs, request.prompt_token_ids, self.prompt_logprobs.get(prompt_index), 0)
            self._add_logprobs(logprobs, token_ids, entries, start)
        if self.echo_only:  # nothing generated: the length allowed was 0 (OpenAI's answer too)
            return CompletionChoice(index=index, text=prompt, finish_reason="length", logprobs=logprobs)
        return CompletionChoice(
            index=index, text=prompt + text, finish_reason=c.finish_reason, logprobs=logprobs, stop_reason=c.stop_reason
        )

    def _add_logprobs(
        self,
        out: CompletionLogprobs,
        token_ids: list[int],
        entries: list[dict[int, float] | None] | None,
        offset: int,
    ) -> None:
        """Append tokens and their logprobs (an entry of None, the prompt's first token's: no logprob) to ``out``,
        their offsets counted from ``offset``."""
        tokenizer = self.tokenizer
        for i, token_id in enumerate(token_ids):
            candidates = entries[i] if entries is not None else None
            text = tokenizer.token_text(token_id) if tokenizer else str(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if candidates is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = sorted(candidates.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            out.token_logprobs.append(candidates[token_id])
            out.top_logprobs.append(
                {(tokenizer.token_text(t) if tokenizer else str(t)): lp for t, lp in top} if top else None
            )

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
                view.keep_prompt_logprobs(i, output)
                choices = []
                for c in output.outputs:
                    index = i * view.n + c.index
                    choices.append(view.choice(i, requests[i], c, first=index not in started))
                    started.add(index)
                    num_output += 0 if view.echo_only else len(c.token_ids)
                yield view.chunk(choices)
            if include_usage:
                num_prompt = sum(len(r.prompt_token_ids) for r in requests)
                yield view.chunk([], usage(num_prompt, num_output))
        except (EngineNotReadyError, ValueError) as e:
            yield stream_error(e)
