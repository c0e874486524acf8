"""The benchmark workloads of DESIGN.md §6, as token-id requests with fixed seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Random prompt tokens come from the ordinary vocabulary, away from Qwen's special ids (>= 151643).
TOKEN_RANGE = (1000, 150_000)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def random_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> list[BenchRequest]:
    """``num_prompts`` random-token prompts with lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, rng.randint(*input_len)), rng.randint(*output_len)) for _ in range(num_prompts)]


def shared_prefix_workload(
    num_prompts: int = 64,
    prefix_len: int = 512,
    tail_len: tuple[int, int] = (32, 64),
    output_len: int = 32,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests sharing one ``prefix_len``-token system prompt, each with its own tail."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    return [BenchRequest(prefix + _tokens(rng, rng.randint(*tail_len)), output_len) for _ in range(num_prompts)]


WORKLOADS = {
    "cpu-mixed": lambda: random_workload(64, (32, 512), (16, 128)),
    "shared-prefix": shared_prefix_workload,
}


def parse_range(text: str) -> tuple[int, int]:
    """'32-512' -> (32, 512); '64' -> (64, 64)."""
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"expected a length or a range like 32-512, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}")
    return lo, hi
