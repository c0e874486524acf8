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


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
