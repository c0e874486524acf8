"""POST /v1/chat/completions: chat template, Qwen3 thinking split, streaming and not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from qwenbatch.engine.async_engine import EngineNotReadyError
from qwenbatch.engine.request import EngineRequest
from qwenbatch.outputs import CompletionOutput, RequestOutput
from qwenbatch.server.common import (
    SSE_DONE,
    APIError,
    OrjsonResponse,
    ServerContext,
    abort_on_disconnect,
    check_text_size,
    collect,
    make_request,
    sampling_params,
    sse,
    stream_error,
    usage,
)
from qwenbatch.server.guard import allowed_priority
from qwenbatch.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from qwenbatch.tokenizer import THINK_END, THINK_START, ReasoningStream, Tokenizer, split_reasoning

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    ctx: ServerContext = raw.app.state.ctx
    engine = ctx.admit(body.model, body.n, param="n")
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer (dummy weights); use /v1/completions with token ids")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    if body.truncate_prompt_tokens is None:
        check_text_size(engine, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), "messages")
    top_logprobs = body.top_logprobs or 0
    params = sampling_params(
        body, body.max_completion_tokens or body.max_tokens, top_logprobs if body.logprobs else None
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    priority = allowed_priority(raw, body.priority)

    def tokenize() -> tuple[str, EngineRequest]:
        try:
            prompt = tokenizer.apply_chat_template(
                messages, enable_thinking=body.thinking(), add_generation_prompt=body.add_generation_prompt
            )
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        truncate = body.truncate_prompt_tokens
        return prompt, make_request(engine, request_id, prompt, params, body.stream, truncate, "messages", priority)

    # Off the event loop: a long conversation's template and tokens would stall every other request.
    prompt, request = await run_in_threadpool(tokenize)
    view = _ChatView(
        request_id,
        ctx.model_name,
        tokenizer,
        # Split <think>...</think> off only for models that have the tokens (Qwen3), as vLLM's qwen3 parser.
        thinking=tokenizer.has_token(THINK_END),
        opened=prompt.rstrip().endswith(THINK_START),
        return_reasoning=body.return_reasoning is not False,
        top_logprobs=top_logprobs if body.logprobs else None,
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        [stream] = ctx.open_streams([request])
        return StreamingResponse(
            _stream(ctx, raw, request, stream, view, include_usage), media_type="text/event-stream"
        )
    [output] = await collect(ctx.open_streams([request]), raw)
    choices = [view.choice(c) for c in output.outputs]
    totals = usage(output.num_prompt_tokens, output.num_output_tokens)
    response = ChatCompletion(id=request_id, created=view.created, model=view.model, choices=choices, usage=totals)
    return OrjsonResponse(response.model_dump(exclude_none=True))


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
    ) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.thinking, self.opened, self.return_reasoning = thinking, opened, return_reasoning
        self.top_logprobs = top_logprobs
        self.created = int(time.time())
        self.parsers: dict[int, ReasoningStream] = {}

    def choice(self, c: CompletionOutput) -> ChatChoice:
        reasoning, content = split_reasoning(c.text, self.opened) if self.thinking else (None, c.text)
        message = AssistantMessage(content=content, reasoning_content=reasoning if self.return_reasoning else None)
        return ChatChoice(
            index=c.index,
            message=message,
            finish_reason=c.finish_reason,
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
        if not content and not reasoning and not c.finished and not c.token_ids:
            return None
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None)
        if delta.content is None and delta.reasoning_content is None and not c.finished:
            delta.content = ""  # a token that is held back still counts for logprobs
        return ChatChunkChoice(index=c.index, delta=delta, finish_reason=c.finish_reason, logprobs=self.logprobs(c))

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
    ctx: ServerContext,
    raw: Request,
    request: EngineRequest,
    outputs: AsyncIterator[RequestOutput],
    view: _ChatView,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    watcher = abort_on_disconnect(raw, ctx.engine, [request.request_id])
    num_output = 0
    try:
        roles = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(len(request.seqs))
        ]
        yield sse(view.chunk(roles))
        async for output in outputs:
            num_output += sum(len(c.token_ids) for c in output.outputs)
            choices = [choice for c in output.outputs if (choice := view.delta_choice(c)) is not None]
            if choices:
                yield sse(view.chunk(choices))
        if include_usage:
            yield sse(view.chunk([], usage(len(request.prompt_token_ids), num_output)))
    except (EngineNotReadyError, ValueError) as e:
        yield stream_error(e)
    finally:
        watcher.cancel()
    yield SSE_DONE
