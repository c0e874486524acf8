"""OpenAIServingAPI: every handler over one engine client, and ``call`` for a request given as a route and a
JSON body (a batch line), answering exactly what the HTTP server would send for it."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from qwenbatch.engine.async_engine import AsyncEngine
from qwenbatch.serving.chat import OpenAIServingChat
from qwenbatch.serving.completion import OpenAIServingCompletion
from qwenbatch.serving.embedding import OpenAIServingEmbedding
from qwenbatch.serving.errors import APIError, validation_error
from qwenbatch.serving.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    RERANK_URL,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
)
from qwenbatch.serving.rerank import OpenAIServingRerank
from qwenbatch.serving.tokenization import OpenAIServingTokenization


class OpenAIServingAPI:
    """The chat, completions, rerank, embeddings and tokenization handlers of one engine client."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat = OpenAIServingChat(engine, served_model_names)
        self.completion = OpenAIServingCompletion(engine, served_model_names)
        self.rerank = OpenAIServingRerank(engine, served_model_names)
        self.embedding = OpenAIServingEmbedding(engine, served_model_names)
        self.tokenization = OpenAIServingTokenization(engine, served_model_names)
        self._routes = {
            CHAT_URL: (ChatCompletionRequest, self.chat.create),
            COMPLETIONS_URL: (CompletionRequest, self.completion.create),
            RERANK_URL: (RerankRequest, self.rerank.rerank),
            EMBEDDINGS_URL: (EmbeddingRequest, self.embedding.create),
        }

    async def call(self, url: str, body: dict, priority: int = 0) -> tuple[int, dict]:
        """``(status, response body)`` for ``body`` sent to ``url``, non-streaming: 200 and the response, or
        the error status and OpenAI's error body. Cancelling the call aborts its requests."""
        try:
            return 200, await self._call(url, body, priority)
        except APIError as e:
            return e.status, e.body()

    async def _call(self, url: str, body: dict, priority: int) -> dict:
        if url not in self._routes:
            raise APIError(404, f"{url} is not an endpoint of this server", "not_found_error", param="url")
        model, handler = self._routes[url]
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e.errors()) from e
        if getattr(request, "stream", False):
            raise APIError(400, "stream: a batch request cannot stream", param="stream")
        response = await handler(request, priority)
        return response.model_dump(exclude_none=True) if isinstance(response, BaseModel) else response
