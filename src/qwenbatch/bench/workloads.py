"""The benchmark workloads of DESIGN.md §6, as token-id requests with fixed seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass

QWEN_VOCAB = 151_936


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Ordinary tokens: for Qwen's vocabulary [1000, 150000), away from the special ids (>= 151643).
    low, high = min(1000, vocab_size // 4), min(150_000, vocab_size)
    return [rng.randrange(low, high) for _ in range(n)]


def random_workload(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    vocab_size: int = QWEN_VOCAB,
) -> list[BenchRequest]:
    """``num_prompts`` random-token prompts with lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [
        BenchRequest(_tokens(rng, rng.randint(*input_len), vocab_size), rng.randint(*output_len))
        for _ in range(num_prompts)
    ]


def shared_prefix_workload(
    num_prompts: int = 64,
    prefix_len: int = 512,
    tail_len: tuple[int, int] = (32, 64),
    output_len: int = 32,
    seed: int = 0,
    vocab_size: int = QWEN_VOCAB,
) -> list[BenchRequest]:
    """Requests sharing one ``prefix_len``-token system prompt, each with its own tail."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    return [
        BenchRequest(prefix + _tokens(rng, rng.randint(*tail_len), vocab_size), output_len) for _ in range(num_prompts)
    ]


WORKLOADS = {
    "cpu-mixed": lambda vocab_size: random_workload(64, (32, 512), (16, 128), vocab_size=vocab_size),
    "shared-prefix": lambda vocab_size: shared_prefix_workload(vocab_size=vocab_size),
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
