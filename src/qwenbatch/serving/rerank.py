"""Rerank (vLLM's and Jina's shape) and score: Qwen3-Reranker P(yes) of query-document pairs."""

from __future__ import annotations

import uuid

from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.serving.base import OpenAIServing, collect
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import RerankRequest, ScoreRequest


class OpenAIServingRerank(OpenAIServing):
    """``POST /v1/rerank`` and ``POST /v1/score``."""

    async def _score(
        self, base_id: str, pairs: list[tuple[str, str]], instruction: str | None, priority: int
    ) -> tuple[list[EngineRequest], list[int]]:
        def build(inputs: InputProcessor) -> tuple[list[EngineRequest], list[int]]:
            try:
                inputs.rerank_formatter  # noqa: B018 - its ValueError names the model, not the documents
            except ValueError as e:
                raise APIError(400, str(e), param="model") from e
            return inputs.make_score_requests(base_id, pairs, instruction, priority)

        return await self.process(build, param="documents")

    async def rerank(self, body: RerankRequest, priority: int = 0) -> dict:
        """The documents' relevance scores, best first (the first ``top_n``)."""
        self.admit(body.model, len(body.documents), param="documents")
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        base_id = f"rerank-{uuid.uuid4().hex}"
        pairs = [(body.query, d) for d in documents]
        requests, truncated = await self._score(base_id, pairs, body.instruction, priority)
        outputs = await collect(self.open_streams(requests))
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
        return {"id": base_id, "model": self.model_name, "usage": {"total_tokens": total}, "results": results}

    async def score(self, body: ScoreRequest, priority: int = 0) -> dict:
        """P(yes) of each (text_1, text_2) pair; one text_1 pairs with every text_2."""
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        self.admit(body.model, max(len(firsts), len(seconds)), param="text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            message = f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one or as many"
            raise APIError(400, message, param="text_1")
        base_id = f"score-{uuid.uuid4().hex}"
        pairs = list(zip(firsts, seconds, strict=True))
        requests, _ = await self._score(base_id, pairs, body.instruction, priority)
        outputs = await collect(self.open_streams(requests))
        data = [{"index": i, "object": "score", "score": out.score} for i, out in enumerate(outputs)]
        total = sum(len(r.prompt_token_ids) for r in requests)
        usage = {"prompt_tokens": total, "total_tokens": total}
        return {"id": base_id, "object": "list", "model": self.model_name, "data": data, "usage": usage}
