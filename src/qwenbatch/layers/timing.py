"""Timing kernels against each other at load, for the choices the CPU's flags cannot settle."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch


def best_times_ms(candidates: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each candidate's best time in milliseconds: a warm-up call each, then ``repeats`` rounds, alternating, so that
    a noisy neighbour on a shared host slows them alike."""
    best = dict.fromkeys(candidates, float("inf"))
    with torch.inference_mode():
        for run in candidates.values():
            run()
        for _ in range(repeats):
            for name, run in candidates.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best
