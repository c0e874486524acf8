"""Row counts at which oneDNN runs a prepacked bf16 linear on one thread, found at load by timing, where the linear's
rows are then cut into pieces it runs on all threads.

oneDNN chooses how to divide a matmul among the threads by its shape. On 2 threads of the AMX kind it leaves one of
them idle for some row counts: the default model's qkv at 768-1,152 rows, o at 512-1,280, down at 768-1,280, each at
half speed, while 256-384 rows of the same linears run on both (benchmarks/onednn_rows.py, BENCHMARKS.md). A
prompt of ~1,000 tokens alone is a chunk of such rows; its prefill ran 1.16x faster with those linears cut into
pieces of at most ``PIECE_ROWS`` rows. Which row counts, shapes and CPUs do it is not something the flags tell,
so each of the model's linear shapes is timed at a few row counts, whole and in pieces, and the bucket of rows
around a timed count (``linear.row_bucket``) is split only where the pieces were clearly faster.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from qwenbatch.layers.linear import PIECE_ROWS, PackedLinear
from qwenbatch.layers.timing import best_times_ms

# Row counts timed, each standing for its bucket (linear.row_bucket). Above them no shape was seen to run on one
# thread; at 512 rows o did, but its pieces (two calls and a copy) were no faster.
TIMED_ROWS = (768, 1024, 1280)
# The pieces must be this much faster to be chosen: a best of 2 on a shared host errs by a few percent, and a
# linear left on one thread runs ~1.3-2x slower, where the pieces pay for copying their outputs together.
SPLIT_MARGIN = 0.8


@dataclass(frozen=True)
class ShapeTiming:
    """A linear shape at ``rows`` rows, whole and in pieces (ms, best of a few)."""

    in_features: int
    out_features: int
    rows: int
    whole_ms: float
    pieces_ms: float

    @property
    def split(self) -> bool:
        return self.pieces_ms < SPLIT_MARGIN * self.whole_ms


@dataclass(frozen=True)
class RowPiecesChoice:
    """The timed row counts at which each linear shape is split, and the timings that chose them."""

    timings: tuple[ShapeTiming, ...] = ()

    def split_rows(self, in_features: int, out_features: int) -> frozenset[int]:
        """The timed row counts (bucket centres) at which a linear of this shape runs in pieces."""
        return frozenset(
            t.rows for t in self.timings if t.split and (t.in_features, t.out_features) == (in_features, out_features)
        )

    def describe(self) -> str:
        """For the log and bench JSON, e.g. "rows in pieces of 384: 4864x896 at 768, 1024 rows (timed whole / in
        pieces: 5.77 / 3.24 ms, 7.10 / 4.44 ms)", or "no rows in pieces" where every shape ran as fast whole."""
        split = [t for t in self.timings if t.split]
        if not split:
            return "no rows in pieces"
        shapes: dict[tuple[int, int], list[ShapeTiming]] = {}
        for t in split:
            shapes.setdefault((t.in_features, t.out_features), []).append(t)
        parts = [
            f"{k}x{n} at {', '.join(str(t.rows) for t in ts)} rows (timed whole / in pieces: "
            + ", ".join(f"{t.whole_ms:.2f} / {t.pieces_ms:.2f} ms" for t in ts)
            + ")"
            for (k, n), ts in shapes.items()
        ]
        return f"rows in pieces of {PIECE_ROWS}: " + "; ".join(parts)


def prefill_linears(model: nn.Module) -> list[PackedLinear]:
    """``model``'s packed linears but its LM head (which sees only the rows that sample, never a chunk's)."""
    lm_head = getattr(model, "lm_head", None)
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m is not lm_head]


def choose_row_pieces(
    linears: Iterable[PackedLinear], rows: Iterable[int] = TIMED_ROWS, repeats: int = 2
) -> RowPiecesChoice:
    """Time each distinct shape among bf16 ``linears`` at each of ``rows`` rows, whole and in pieces (a warm-up call
    each, alternating, best of ``repeats``)."""
    shapes = {(m.in_features, m.out_features): m for m in linears if m.packed_weight.dtype == torch.bfloat16}
    generator = torch.Generator().manual_seed(0)
    timings = []
    for (k, n), linear in shapes.items():
        for m in rows:
            x = torch.randn(m, k, generator=generator).bfloat16()
            candidates = {"whole": linear.whole_forward, "pieces": linear.pieces_forward}
            best = best_times_ms({name: partial(run, x) for name, run in candidates.items()}, repeats)
            timings.append(ShapeTiming(k, n, m, best["whole"], best["pieces"]))
    return RowPiecesChoice(tuple(timings))


def apply(linears: Iterable[PackedLinear], choice: RowPiecesChoice) -> None:
    """Set each linear's row buckets to run in pieces from ``choice``."""
    for linear in linears:
        linear.pieces_at = choice.split_rows(linear.in_features, linear.out_features)
