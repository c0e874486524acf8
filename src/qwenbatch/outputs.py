"""What the engine returns for a request (vLLM's RequestOutput / CompletionOutput shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with ``n > 1`` has several)."""

    index: int
    text: str
    token_ids: list[int]
    # "stop" (eos, stop string or stop token), "length" (max_tokens or context), "abort", "error";
    # None while the sequence is still running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, if any.
    stop_reason: str | int | None = None
    # Per generated token: {token_id: logprob} holding the sampled token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    # For thinking models: the text inside <think>...</think>; ``text`` then holds only the answer.
    reasoning_content: str | None = None
    # Set when finish_reason is "error".
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RerankResult:
    """One document scored against a query by ``LLM.rerank`` / ``LLM.score``."""

    index: int  # position in the input
    score: float  # P(yes), in [0, 1]
    document: str
    truncated_tokens: int = 0  # body tokens dropped to fit the reranker's max length


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    score: float | None = None  # a scoring request's P(yes) (reranker); outputs is empty then
    # An embedding request's vector, L2-normalized (float32 [hidden], on the CPU); outputs is empty then.
    embedding: torch.Tensor | None = None
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token id: logprob} holding the
    # prompt's token and the top ones at that position; and the prompt token's rank there (1: the likeliest). A
    # streaming request has them in its first output only.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
