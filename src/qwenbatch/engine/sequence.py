"""Sequence: one generated continuation's tokens and its progress through the KV cache.

Pure Python: the scheduler and the block manager import this, and neither needs torch or a
tokenizer. What a sequence produces beyond its token ids (text, logprobs, its sampler's generator)
lives on its request (``request.SampleState``).
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from qwenbatch.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output), how many of them have K/V in the cache, and its blocks."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    priority: int = 0  # lower is served earlier (vLLM's convention); scheduler.py says how
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of its full blocks (memo)
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    # "stop", "length", "abort" or "error" once finished (CompletionOutput.finish_reason).
    finish_reason: str | None = None
    # A pooling sequence: prefill, then instead of a sampled token P(yes) (a reranker pair) or an embedding.
    score_only: bool = False
    # prompt_logprobs: the first position whose next prompt token's logprob is still to compute (on the request's
    # first sequence; None when there is none, or none left). While set, no prefix-cache hit is taken: cached
    # positions would produce no logits.
    prompt_logprobs_from: int | None = None
    # The output's ids again, for the penalties, which read all of them every step (see output_ids_so_far).
    _output_ids: array = field(default_factory=lambda: array("q"), init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def output_ids_so_far(self) -> array:
        """The output's token ids as an int64 array, extended by the tokens added since the last call (outputs only
        grow; a preempted sequence keeps them for its recompute): a step's penalties then cost O(new tokens) here,
        not a copy of every output list and its conversion from Python ints (8.5 ms a step at 256 rows of 512)."""
        self._output_ids.extend(self.token_ids[self.num_prompt_tokens + len(self._output_ids) :])
        return self._output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
