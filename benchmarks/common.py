"""Shared helpers for the benchmark scripts: real chat prompts and timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# Real instructions (Chinese and English) for chat-shaped workloads.
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
]


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
