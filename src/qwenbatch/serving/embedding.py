"""Embeddings (OpenAI's /v1/embeddings): each input's vector from an embedding model (task embed)."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.serving.base import OpenAIServing, collect
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import EmbeddingRequest


def input_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's input as a list of inputs (texts or token ids)."""
    if isinstance(value, str) or isinstance(value[0], int):
        return [value]
    return list(value)


class OpenAIServingEmbedding(OpenAIServing):
    """``POST /v1/embeddings``."""

    async def create(self, body: EmbeddingRequest, priority: int = 0) -> dict:
        """One embedding per input, in input order: floats, or base64 of float32 little-endian bytes."""
        inputs = input_list(body.input)
        processor = self.admit(body.model, len(inputs), param="input")
        if not processor.embeds:
            raise APIError(400, "this model does not embed texts: serve an embedding model (task embed)", param="model")
        base_id = f"embd-{uuid.uuid4().hex}"

        def build(processor: InputProcessor) -> list[EngineRequest]:
            return [
                processor.make_embed_request(f"{base_id}-{i}", value, priority, body.truncate_prompt_tokens)
                for i, value in enumerate(inputs)
            ]

        requests = await self.process(build, param="input")
        outputs = await collect(self.open_streams(requests))
        data = []
        for i, output in enumerate(outputs):
            if output.embedding is None:
                raise APIError(500, output.outputs[0].error if output.outputs else "no embedding", "server_error")
            vector = self._shaped(output.embedding.numpy(), body.dimensions)
            encoded = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if body.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        tokens = sum(len(r.prompt_token_ids) for r in requests)
        return {
            "id": base_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @staticmethod
    def _shaped(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
        """``vector`` cut to its first ``dimensions`` values and normalized again (Matryoshka embeddings)."""
        if dimensions is None:
            return vector
        if dimensions > vector.size:
            raise APIError(400, f"dimensions must be at most the model's {vector.size}", param="dimensions")
        head = vector[:dimensions]
        return head / max(float(np.linalg.norm(head)), 1e-12)
