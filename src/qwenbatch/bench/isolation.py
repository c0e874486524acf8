"""Running benchmarked systems side by side fairly: each run in a fresh process, the order alternated by round."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def in_fresh_process(fn: Callable[..., R], *args) -> R:
    """``fn(*args)`` in a freshly spawned process, so that no run inherits another's state (in one process,
    cpu-mixed ran ~6% slower on our engine after a transformers run than before any: 21.2 against 20.0 s) and
    each system's peak RSS is its own. ``fn`` and ``args`` must pickle: module-level functions, plain data."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def alternating_rounds(systems: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, system) for ``repeats`` rounds of every system in turn, every other round in reverse order, so that
    a drift of the machine's speed falls on all of them alike: a, b, b, a, a, b for two systems and three rounds."""
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    for round_ in range(repeats):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            yield round_, system
