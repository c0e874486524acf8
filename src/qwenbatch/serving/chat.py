"""Chat completions: chat template, Qwen3 thinking split, streaming and not."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from pydantic import BaseModel

from qwenbatch.engine.async_engine import EngineNotReadyError
from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.outputs import CompletionOutput, RequestOutput
from qwenbatch.serving.base import OpenAIServing, collect, prompt_logprobs_json, sampling_params, stream_error, usage
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
    message_dicts,
)
from qwenbatch.serving.tool_calls import OPEN, ToolCallStream, forced_calls, parse_tool_calls, parses_tool_calls
from qwenbatch.tokenizer import THINK_END, THINK_START, ReasoningStream, Tokenizer, split_reasoning


class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions``."""

    async def create(
        self, body: ChatCompletionRequest, priority: int = 0
    ) -> ChatCompletion | AsyncIterator[BaseModel | dict]:
        """The completion, or for ``stream`` an iterator of chunks (an error body ends a failed one)."""
        inputs = self.admit(body.model, body.n, param="n")
        tokenizer = inputs.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer (dummy weights); use /v1/completions with token ids")
        messages = message_dicts(body.messages)
        top_logprobs = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, max_tokens, top_logprobs if body.logprobs else None, inputs.sampling_defaults)
        forced = forced_calls(body, tokenizer.has_token(OPEN))
        if forced is not None:
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice required or a named function is a structured output itself: drop "
                               "response_format and structured_outputs", param="tool_choice")  # fmt: skip
            params = dataclasses.replace(params, structured_outputs=forced)
        await self.check_params(body, params, inputs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        truncate = body.truncate_prompt_tokens
        if truncate is None:
            size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
            try:
                inputs.check_text_size(size)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from e

        def tokenize(inputs: InputProcessor) -> tuple[str, EngineRequest]:
            prompt = inputs.chat_prompt(messages, **body.template_options())
            return prompt, inputs.make_request(request_id, prompt, params, body.stream, priority, truncate)

        prompt, request = await self.process(tokenize, param="messages")
        view = _ChatView(
            request_id,
            self.model_name,
            tokenizer,
            # Split <think>...</think> off only for models that have the tokens (Qwen3), as vLLM's qwen3 parser.
            thinking=tokenizer.has_token(THINK_END),
            opened=prompt.rstrip().endswith(THINK_START),
            return_reasoning=body.return_reasoning is not False,
            top_logprobs=top_logprobs if body.logprobs else None,
            tool_calls=parses_tool_calls(body),
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            [stream] = self.open_streams([request])
            return _stream(request, stream, view, include_usage)
        [output] = await collect(self.open_streams([request]))
        choices = [view.choice(c) for c in output.outputs]
        return ChatCompletion(
            id=request_id,
            created=view.created,
            model=view.model,
            choices=choices,
            usage=usage(output.num_prompt_tokens, output.num_output_tokens),
            prompt_logprobs=await self.process(lambda _: prompt_logprobs_json(output, tokenizer)),
        )


def _finish_reason(c: CompletionOutput, calls: list) -> str | None:
    """OpenAI's "tool_calls" where an output that ended by itself made calls; "length" still says one was cut."""
    return "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


class _ChatView:
    """Turns one request's engine outputs into chat choices and chunks."""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        thinking: bool,
        opened: bool,
        return_reasoning: bool,
        top_logprobs: int | None,
        tool_calls: bool = False,
    ) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.thinking, self.opened, self.return_reasoning = thinking, opened, return_reasoning
        self.top_logprobs = top_logprobs
        self.tool_calls = tool_calls  # the content is read for Qwen's <tool_call> blocks
        self.created = int(time.time())
        self.parsers: dict[int, ReasoningStream] = {}
        self.call_streams: dict[int, ToolCallStream] = {}

    def choice(self, c: CompletionOutput) -> ChatChoice:
        reasoning, content = split_reasoning(c.text, self.opened) if self.thinking else (None, c.text)
        calls = []
        if self.tool_calls:
            content, calls = parse_tool_calls(content)
        message = AssistantMessage(
            content=content, reasoning_content=reasoning if self.return_reasoning else None, tool_calls=calls or None
        )
        return ChatChoice(
            index=c.index,
            message=message,
            finish_reason=_finish_reason(c, calls),
            logprobs=self.logprobs(c),
            stop_reason=c.stop_reason,
        )

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def delta_choice(self, c: CompletionOutput) -> ChatChunkChoice | None:
        """The chunk for one sequence's delta, or None when it carries nothing to send yet."""
        reasoning, content = None, c.text
        if self.thinking:
            parser = self.parsers.setdefault(c.index, ReasoningStream(self.opened))
            reasoning, content = parser.feed(c.text)
            if c.finished:
                more_reasoning, more_content = parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            if not self.return_reasoning:
                reasoning = ""
        calls = []
        if self.tool_calls:
            stream = self.call_streams.setdefault(c.index, ToolCallStream())
            content = stream.feed(content)
            if c.finished:
                rest, calls = stream.finish()
                content += rest
        if not content and not reasoning and not c.finished and not c.token_ids:
            return None
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None)
        if calls:
            delta.tool_calls = [DeltaToolCall(index=i, id=t.id, function=t.function) for i, t in enumerate(calls)]
        if delta.content is None and delta.reasoning_content is None and not c.finished:
            delta.content = ""  # a token that is held back still counts for logprobs
        finish_reason = _finish_reason(c, calls)
        return ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish_reason, logprobs=self.logprobs(c))

    def logprobs(self, c: CompletionOutput) -> ChoiceLogprobs | None:
        if self.top_logprobs is None or c.logprobs is None:
            return None
        content = []
        for token_id, candidates in zip(c.token_ids, c.logprobs, strict=True):
            top = sorted(candidates.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            text = self.tokenizer.token_text(token_id)
            content.append(
                TokenLogprob(
                    token=text,
                    logprob=candidates[token_id],
                    bytes=list(text.encode()),
                    top_logprobs=[self._top(t, lp) for t, lp in top],
                )
            )
        return ChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


async def _stream(
    request: EngineRequest,
    outputs: AsyncIterator[RequestOutput],
    view: _ChatView,
    include_usage: bool,
) -> AsyncIterator[BaseModel | dict]:
    num_output = 0
    async with aclosing(outputs):  # closing this stream early aborts the request
        try:
            roles = [
                ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(len(request.seqs))
            ]
            yield view.chunk(roles)
            async for output in outputs:
                num_output += sum(len(c.token_ids) for c in output.outputs)
                choices = [choice for c in output.outputs if (choice := view.delta_choice(c)) is not None]
                if choices:
                    yield view.chunk(choices)
            if include_usage:
                yield view.chunk([], usage(len(request.prompt_token_ids), num_output))
        except (EngineNotReadyError, ValueError) as e:
            yield stream_error(e)
