"""POST /v1/rerank (and /rerank), POST /score (and /v1/score): Qwen3-Reranker scoring, vLLM's and Jina's shapes."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.engine.request import EngineRequest
from qwenbatch.rerank import RerankFormatter
from qwenbatch.server.common import APIError, OrjsonResponse, ServerContext, collect
from qwenbatch.server.guard import allowed_priority
from qwenbatch.server.protocol import RerankRequest, ScoreRequest

router = APIRouter()


def _formatter(engine: LLMEngine) -> RerankFormatter:
    try:
        return engine.rerank_formatter
    except ValueError as e:
        raise APIError(400, str(e), param="model") from e


def _score_requests(
    engine: LLMEngine, base_id: str, pairs: list[tuple[str, str]], instruction: str | None, priority: int
) -> tuple[list[EngineRequest], list[int]]:
    formatter = _formatter(engine)
    requests, truncated = [], []
    for i, (query, document) in enumerate(pairs):
        prompt = formatter.build(query, document, instruction)
        try:
            requests.append(engine.make_score_request(f"{base_id}-{i}", prompt.token_ids, priority=priority))
        except ValueError as e:
            raise APIError(400, f"pair {i}: {e}", param="documents") from e
        truncated.append(prompt.truncated_tokens)
    return requests, truncated


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, raw: Request):
    ctx: ServerContext = raw.app.state.ctx
    engine = ctx.admit(body.model, len(body.documents), param="documents")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    base_id = f"rerank-{uuid.uuid4().hex}"
    pairs = [(body.query, d) for d in documents]
    requests, truncated = await run_in_threadpool(
        _score_requests, engine, base_id, pairs, body.instruction, allowed_priority(raw, body.priority)
    )
    outputs = await collect(ctx.open_streams(requests), raw)
    order = sorted(range(len(outputs)), key=lambda i: -outputs[i].score)
    if body.top_n is not None:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": outputs[i].score}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        if truncated[i]:
            result["truncated_tokens"] = truncated[i]
        results.append(result)
    total = sum(len(r.prompt_token_ids) for r in requests)
    return OrjsonResponse(
        {"id": base_id, "model": ctx.model_name, "usage": {"total_tokens": total}, "results": results}
    )


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, raw: Request):
    ctx: ServerContext = raw.app.state.ctx
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    engine = ctx.admit(body.model, max(len(firsts), len(seconds)), param="text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        message = f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one or as many"
        raise APIError(400, message, param="text_1")
    base_id = f"score-{uuid.uuid4().hex}"
    pairs = list(zip(firsts, seconds, strict=True))
    requests, _ = await run_in_threadpool(
        _score_requests, engine, base_id, pairs, body.instruction, allowed_priority(raw, body.priority)
    )
    outputs = await collect(ctx.open_streams(requests), raw)
    data = [{"index": i, "object": "score", "score": out.score} for i, out in enumerate(outputs)]
    total = sum(len(r.prompt_token_ids) for r in requests)
    usage = {"prompt_tokens": total, "total_tokens": total}
    return OrjsonResponse({"id": base_id, "object": "list", "model": ctx.model_name, "data": data, "usage": usage})
