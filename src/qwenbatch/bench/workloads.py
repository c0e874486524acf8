"""The benchmark workloads of DESIGN.md §6, as token-id requests with fixed seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass

QWEN_VOCAB = 151_936

# DESIGN §6 chat-real: 32 real instructions (Chinese and English) for chat-shaped workloads.
CHAT_INSTRUCTIONS = [
    "用一句话介绍Python编程语言。",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "请用三句话解释什么是哈希表，以及它的查找为什么快。",
    "Explain the difference between a process and a thread, and when you would use each.",
    "写一个SQL查询，找出订单金额最高的前5位客户，并说明每一步的作用。",
    "What does the `yield` keyword do in Python? Give a short example of a generator.",
    "请比较Python中的列表和元组，各举一个适合使用的场景。",
    "Describe how a binary search works and state its time complexity.",
    "用JavaScript写一个防抖函数，并解释它的用途。",
    "How do I read a CSV file with pandas and compute the mean of one column?",
    "请解释什么是快速排序，并给出它的平均和最坏时间复杂度。",
    "Write a bash one-liner that counts the lines of all .py files in a directory tree.",
    "什么是RESTful API？请列出三个设计原则。",
    "Explain what a race condition is and one way to prevent it in Python.",
    "用Go语言写一个并发安全的计数器。",
    "What is the difference between `==` and `is` in Python?",
    "请写一个Python装饰器，记录函数每次调用所花的时间。",
    "Explain what Big-O notation means, with two examples.",
    "用C语言写一个函数，反转一个单向链表。",
    "How would you remove duplicate rows from a pandas DataFrame?",
    "请解释HTTP和HTTPS的区别。",
    "Write a regular expression that matches an IPv4 address and explain it.",
    "什么是闭包？请用Python举例说明。",
    "Describe the steps of a git rebase and when it is better than a merge.",
    "用Rust写一个函数，返回向量中的最大值。",
    "What is a Docker container and how is it different from a virtual machine?",
    "请解释数据库事务的ACID特性。",
    "Write a Python class for a stack with push, pop and peek methods.",
    "什么是梯度下降？请用两句话解释。",
    "How do you handle exceptions in JavaScript promises?",
    "请写一个Shell脚本，备份一个目录到带日期的压缩包。",
    "Explain the difference between TCP and UDP in three sentences.",
]


def serve_workload(num_prompts: int, max_tokens: int) -> list[tuple[str, dict]]:
    """The ``serve`` workload: chat requests cycling through CHAT_INSTRUCTIONS, each made unique by its number."""
    return [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"{CHAT_INSTRUCTIONS[i % len(CHAT_INSTRUCTIONS)]} (#{i})"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        for i in range(num_prompts)
    ]


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (with ignore_eos), or at most (without)
    ignore_eos: bool = True  # synthetic workloads generate exactly output_len; real requests stop at eos
    temperature: float = 0.0  # 0: greedy, as every system decodes unless asked (bench throughput --temperature)
    top_p: float = 1.0


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
