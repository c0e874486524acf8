"""Shared helpers for the benchmark scripts: real chat prompts and timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from qwenbatch.bench.workloads import CHAT_INSTRUCTIONS  # noqa: F401 (the scripts import it from here)


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
