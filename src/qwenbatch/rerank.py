"""Qwen3-Reranker prompts: the model card's template, truncation of the body only, and the yes/no tokens.

The model card tokenizes three pieces separately and concatenates the ids: the fixed prefix
(system prompt and the start of the user turn), the body ``<Instruct>: …\\n<Query>: …\\n<Document>: …``
truncated to ``max_length`` minus prefix and suffix, and the fixed suffix (the assistant turn with
an empty thought). The score is P("yes") from a softmax over the last position's logits of "no"
and "yes". Every pair of one query shares the prefix and the start of the body, which the prefix
cache computes once.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwenbatch.tokenizer import Tokenizer

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
DEFAULT_MAX_LENGTH = 8192


@dataclass
class RerankPrompt:
    """The token ids of one (query, document) pair, and how many body tokens truncation dropped."""

    token_ids: list[int]
    truncated_tokens: int


def score_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of "no" and "yes" (in that order, as the score's softmax takes them)."""
    ids = tuple(tokenizer.backend.token_to_id(word) for word in ("no", "yes"))
    if None in ids:
        raise ValueError('this tokenizer has no single "yes" and "no" tokens: not a Qwen3-Reranker tokenizer')
    return ids


class RerankFormatter:
    """Builds reranker prompts for one tokenizer (the prefix and suffix are tokenized once)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self.tokenizer = tokenizer
        self.prefix_ids = tokenizer.encode(PREFIX)
        self.suffix_ids = tokenizer.encode(SUFFIX)
        self.max_body = max_length - len(self.prefix_ids) - len(self.suffix_ids)
        if self.max_body < 1:
            raise ValueError(f"max_length {max_length} leaves no room for the query and document")

    def build(self, query: str, document: str, instruction: str | None = None) -> RerankPrompt:
        body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        body_ids = self.tokenizer.encode(body)
        dropped = max(0, len(body_ids) - self.max_body)
        return RerankPrompt(self.prefix_ids + body_ids[: self.max_body] + self.suffix_ids, dropped)
