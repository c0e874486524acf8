"""EngineRequest: one prompt's sequences inside the engine, what each has produced, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qwenbatch.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from qwenbatch.engine.structured_output import OutputGrammar
    from qwenbatch.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class SampleState:
    """What one sequence produces beyond its token ids: its sampler's generator, its text, logprobs, why it
    stopped, a reranker's score, its structured output's match, and how much of it has been streamed (owned by
    the output processor)."""

    generator: torch.Generator | None = None  # per-request seed; None: the global generator
    detokenizer: IncrementalDetokenizer | None = None  # None when the model has no tokenizer
    logprobs: list[dict[int, float]] | None = None  # per output token, when requested
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # set with finish_reason "error"
    score: float | None = None  # a score-only sequence's P(yes)
    embedding: torch.Tensor | None = None  # an embedding model's score-only sequence: its normalized vector
    grammar: OutputGrammar | None = None  # what a structured output must still match
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0
    reported_finished: bool = False


@dataclass(eq=False)
class EngineRequest:
    """A validated request, ready to queue. Built by ``InputProcessor`` on any thread."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    samples: list[SampleState]  # one per sequence, in the same order (seq.index)
    # True: every step that samples reports the new tokens and text (deltas) as a RequestOutput.
    # False: one RequestOutput when the request has finished, holding everything.
    stream: bool = False
    priority: int = 0  # every sequence's priority: lower is served earlier
    arrival_time: float = 0.0  # time.monotonic() when it was made
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # per seq_id
    # The prompt's distinct ids, sorted (int64), made by the engine on the first step whose repetition penalty reads
    # them and kept: one pass over a long prompt a step was ~0.3 ms a sequence at 2,048 tokens.
    distinct_prompt_ids: torch.Tensor | None = None
    # allowed_token_ids as the sampler's bits (int32), made once with the request; None: any token.
    allowed_token_bits: torch.Tensor | None = None
    # prompt_logprobs, per prompt token (None for the first): {token id: logprob} of the token and the top ones, and
    # the token's rank (1: the likeliest); filled as the prompt's chunks run. None where not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    prompt_logprobs_reported: bool = False  # a streaming request sends them once, in its first delta

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def score_only(self) -> bool:
        return self.seqs[0].score_only
