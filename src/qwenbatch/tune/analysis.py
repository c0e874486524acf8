"""Workload analysis for ``qwenbatch tune``: prompt lengths, truncation, and what static batching would pad.

The tuning guides size a static-batch system from these numbers: truncate at the 95th percentile
of prompt length, and pick a batch size whose batches are at least 85% real (non-padding) tokens.
Our engine packs batches, so it pays no padding; the figures show what it saves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

# The guides' threshold: a static batch size is acceptable while >= 85% of its tokens are real.
EFFECTIVE_TOKENS_TARGET = 0.85


def nearest_rank(sorted_values: Sequence[int], q: float) -> int:
    """The q-th percentile by nearest rank: the smallest value with at least q% of the values at or below it."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def effective_token_ratio(lengths: Sequence[int], batch_size: int) -> float:
    """Real / computed prompt tokens when ``lengths`` are cut into batches of ``batch_size`` in this order
    and each batch is padded to its longest prompt."""
    real = padded = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        real += sum(batch)
        padded += len(batch) * max(batch)
    return real / padded


@dataclass
class StaticPadding:
    """What a static-batch system computes at one batch size (prompt tokens only)."""

    batch_size: int
    effective_in_order: float  # batches in input order, as a plain static loop runs them
    effective_sorted: float  # batches of length-sorted prompts (the best a static system can do)


@dataclass
class WorkloadAnalysis:
    """Prompt-length figures of a workload; percentiles are nearest-rank token counts."""

    num_requests: int
    prompt_tokens: int
    mean: float
    p50: int
    p95: int
    p99: int
    max: int
    truncation_length: int  # the guides' max_length: the p95 prompt length
    max_model_len: int | None  # the engine's limit the shares below refer to
    share_over_max_model_len: float | None  # prompts a static system would truncate (our engine rejects them)
    padding: list[StaticPadding] = field(default_factory=list)
    # The largest batch size whose batches keep >= 85% real tokens (None: not even batch 2), in input
    # order and length-sorted.
    static_batch_size_at_target: int | None = None
    static_batch_size_at_target_sorted: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def analyze(lengths: Sequence[int], batch_sizes: Sequence[int], max_model_len: int | None = None) -> WorkloadAnalysis:
    """The analysis of prompts with ``lengths`` tokens, padding figured at each of ``batch_sizes``."""
    if not lengths:
        raise ValueError("the workload has no requests")
    ordered = sorted(lengths)
    padding = [
        StaticPadding(b, effective_token_ratio(lengths, b), effective_token_ratio(ordered, b))
        for b in sorted(set(batch_sizes))
    ]

    def largest_at_target(share: str) -> int | None:
        sizes = [p.batch_size for p in padding if p.batch_size > 1 and getattr(p, share) >= EFFECTIVE_TOKENS_TARGET]
        return max(sizes, default=None)

    over = None if max_model_len is None else sum(n > max_model_len for n in lengths) / len(lengths)
    return WorkloadAnalysis(
        num_requests=len(lengths),
        prompt_tokens=sum(lengths),
        mean=sum(lengths) / len(lengths),
        p50=nearest_rank(ordered, 50),
        p95=nearest_rank(ordered, 95),
        p99=nearest_rank(ordered, 99),
        max=ordered[-1],
        truncation_length=nearest_rank(ordered, 95),
        max_model_len=max_model_len,
        share_over_max_model_len=over,
        padding=padding,
        static_batch_size_at_target=largest_at_target("effective_in_order"),
        static_batch_size_at_target_sorted=largest_at_target("effective_sorted"),
    )
