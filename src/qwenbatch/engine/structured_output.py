"""Structured outputs: which tokens may come next in an output that must match a JSON schema, a regex, a choice or
a Lark grammar (``StructuredOutputs``), from llguidance, one of vLLM's backends (a mask costs ~40-80 µs a row on
the CPU, whatever the device).

A request's sequences each get a match (``OutputGrammar``) when the request is made; every step the engine asks
it for the tokens allowed next, the sampler sets the logits of the others to -inf, and the output processor feeds
it the sampled token and ends the sequence once the match is complete.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING

from qwenbatch.sampling_params import StructuredOutputs

if TYPE_CHECKING:  # imported where first used: an engine that never constrains an output never loads it
    import llguidance
    import torch


def grammar_text(spec: StructuredOutputs) -> str:
    """``spec`` as an llguidance grammar."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    if spec.grammar is not None:
        return matcher.grammar_from_lark(spec.grammar)
    schema = {"type": "object"} if spec.json_object else spec.json
    defaults = {"whitespace_flexible": False} if spec.disable_any_whitespace else None
    return matcher.grammar_from_json_schema(schema, defaults=defaults)


class GrammarCompiler:
    """Matchers over one model's vocabulary (ids past the tokenizer's are never allowed); thread-safe. The
    tokenizer's llguidance form is built on first use (~1 s for Qwen's 151,643 tokens), not at load."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # A batch job sends one schema thousands of times: each grammar is validated once (refusals are not kept).
        self._validate = functools.lru_cache(maxsize=256)(self._validate_uncached)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance.hf

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None
                )
            return self._tokenizer

    def check(self, spec: StructuredOutputs) -> str:
        """``spec``'s grammar; ValueError with llguidance's words where it is not one (a bad schema, regex or
        grammar)."""
        grammar = grammar_text(spec)
        self._validate(grammar)
        return grammar

    def _validate_uncached(self, grammar: str) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error:
            raise ValueError(f"structured output: {error.strip()}")

    def grammars(self, spec: StructuredOutputs, count: int) -> list[OutputGrammar]:
        """``count`` fresh matches of ``spec`` (one for each of a request's sequences); ValueError as ``check``."""
        import llguidance

        grammar, tokenizer = self.check(spec), self._ll_tokenizer()
        return [OutputGrammar(llguidance.LLMatcher(tokenizer, grammar), self._vocab_size) for _ in range(count)]


class OutputGrammar:
    """One sequence's match so far: the tokens it allows next, and the tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed_token_bits(self) -> torch.Tensor:
        """The tokens allowed next, as the sampler takes them (``SamplingRow.allowed_token_bits``): int32 words,
        bit t % 32 of word t // 32 set where token t is allowed."""
        import llguidance.torch

        bits = llguidance.torch.allocate_token_bitmask(1, self._vocab_size)
        llguidance.torch.fill_next_token_bitmask(self._matcher, bits, 0)
        return bits[0]

    def accept(self, token_id: int) -> bool:
        """Take the sampled ``token_id``; False if the match does not allow it (``error`` says why)."""
        return self._matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """True once the match can take nothing more than the end of the output."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
