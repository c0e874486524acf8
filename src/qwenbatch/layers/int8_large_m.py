"""From how many rows a bf16 engine's int8 linears run as a dense bfloat16 matmul instead, chosen at load by timing.

The int8 kernel (csrc/int8_linear.cpp) multiplies 64 int8 pairs an instruction with VNNI; a dense bf16 matmul runs
in oneDNN, in AMX tiles where the CPU has them (a bf16 ``F.linear`` at ~1.8 TFLOP/s on 2 cores of the AMX kind).
At a decode step's few rows the int8 weight's halved bytes win; at a prefill chunk's many rows the weight
dequantized for the call (``Int8Linear.dense_forward``: ~1.2 ms for a 9,728 x 896 gate_up on Zen 5) may cost less
than the faster matmul saves. On Zen 5 (AVX512-BF16, no AMX) the int8 kernel was the faster at every row count
(an MLP at 1,024 rows: 1.32 TOP/s against 0.81 TFLOP/s dense). The CPU's flags cannot say where the
crossover lies, so the engine measures it on the model's first MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from qwenbatch.layers.int8_linear import Int8Linear
from qwenbatch.layers.timing import best_times_ms

# Row counts timed: a mid-size step, and half the CPU's default token budget (a full 2,048-row chunk would double the
# ~230 ms this adds to a start).
TIMED_ROWS = (256, 1024)
# Dense must be this much faster to be chosen: the int8 kernel keeps GGUF weights exact (dense rounds them to bf16),
# and a best of 3 on a shared host can be off by a few percent. On the AMX kind dense is expected ~1.6x faster.
DENSE_MARGIN = 0.9


@dataclass(frozen=True)
class RowsTiming:
    """One MLP's int8 linears at ``rows`` rows of x, in the int8 kernel and dense (ms, best of a few)."""

    rows: int
    int8_ms: float
    dense_ms: float


@dataclass(frozen=True)
class Int8LargeMChoice:
    """From how many rows int8 linears run dense (None: never), and the timings that chose it."""

    dense_from_rows: int | None
    timings: tuple[RowsTiming, ...] = ()

    def describe(self) -> str:
        """For the log, bench JSON and /config, e.g. "int8 kernel at every row count (timed int8 / dense: 1024 rows
        20.1 / 32.8 ms)"."""
        chosen = (
            "int8 kernel at every row count"
            if self.dense_from_rows is None
            else f"dequantized to bf16 for a dense matmul from {self.dense_from_rows} rows"
        )
        timed = ", ".join(f"{t.rows} rows {t.int8_ms:.1f} / {t.dense_ms:.1f} ms" for t in self.timings)
        return f"{chosen} (timed int8 / dense: {timed})" if timed else chosen


NEVER_DENSE = Int8LargeMChoice(None)


def first_mlp_linears(model: nn.Module) -> list[Int8Linear]:
    """The int8 linears of ``model``'s first MLP (gate_up and down: most of a layer's products)."""
    for module in model.modules():
        linears = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
        if all(isinstance(linear, Int8Linear) for linear in linears):
            return linears
    return []


def choose_int8_large_m(
    linears: Sequence[Int8Linear], rows: Sequence[int] = TIMED_ROWS, repeats: int = 3
) -> Int8LargeMChoice:
    """Time ``linears`` together on bf16 x of each of ``rows`` rows, in the int8 kernel and dense (after a warm-up
    call each, alternating, best of ``repeats``), from the most rows down while dense wins by DENSE_MARGIN. Dense
    from the fewest timed rows at which it wins there and at every larger count; never where it loses at the most."""
    if not linears:
        return NEVER_DENSE
    generator = torch.Generator().manual_seed(0)
    timings: list[RowsTiming] = []
    dense_from_rows = None
    for m in sorted(rows, reverse=True):
        xs = [torch.randn(m, linear.in_features, generator=generator).bfloat16() for linear in linears]
        timing = _time_both(linears, xs, repeats)
        timings.insert(0, timing)
        if timing.dense_ms >= DENSE_MARGIN * timing.int8_ms:
            break
        dense_from_rows = m
    return Int8LargeMChoice(dense_from_rows, tuple(timings))


def _time_both(linears: Sequence[Int8Linear], xs: Sequence[torch.Tensor], repeats: int) -> RowsTiming:
    """``linears`` on their ``xs``, in the int8 kernel and dense: a warm-up call each, then best of ``repeats``."""
    pairs = list(zip(linears, xs, strict=True))
    candidates = {
        "int8": lambda: [linear.kernel_forward(x) for linear, x in pairs],
        "dense": lambda: [linear.dense_forward(x) for linear, x in pairs],
    }
    best = best_times_ms(candidates, repeats)
    return RowsTiming(len(xs[0]), best["int8"], best["dense"])


def apply(model: nn.Module, choice: Int8LargeMChoice) -> None:
    """Set every int8 linear of ``model`` but its LM head to run dense from ``choice``'s row count on. The LM head
    was not timed, and dequantizing it would write a vocabulary x hidden bf16 matrix a call (272 MB for the
    default model's)."""
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, Int8Linear) and module is not lm_head:
            module.dense_from_rows = choice.dense_from_rows
