"""The OpenAI routes: thin HTTP wrappers over the serving layer (``app.state.serving``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from qwenbatch.server.common import OrjsonResponse, sse_events, until_disconnect
from qwenbatch.server.guard import allowed_priority
from qwenbatch.serving.api import OpenAIServingAPI
from qwenbatch.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)

router = APIRouter()


def _serving(raw: Request) -> OpenAIServingAPI:
    return raw.app.state.serving


def _respond(result: BaseModel | dict, raw: Request):
    if isinstance(result, BaseModel):
        return OrjsonResponse(result.model_dump(exclude_none=True))
    if isinstance(result, dict):
        return OrjsonResponse(result)
    return StreamingResponse(sse_events(result, raw), media_type="text/event-stream")


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    work = _serving(raw).chat.create(body, allowed_priority(raw, body.priority))
    return _respond(await until_disconnect(work, raw), raw)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request):
    work = _serving(raw).completion.create(body, allowed_priority(raw, body.priority))
    return _respond(await until_disconnect(work, raw), raw)


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, raw: Request):
    work = _serving(raw).rerank.rerank(body, allowed_priority(raw, body.priority))
    return _respond(await until_disconnect(work, raw), raw)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, raw: Request):
    work = _serving(raw).rerank.score(body, allowed_priority(raw, body.priority))
    return _respond(await until_disconnect(work, raw), raw)


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, raw: Request):
    work = _serving(raw).embedding.create(body, allowed_priority(raw, body.priority))
    return _respond(await until_disconnect(work, raw), raw)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request):
    return _respond(await _serving(raw).tokenization.tokenize(body), raw)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request):
    return _respond(await _serving(raw).tokenization.detokenize(body), raw)
