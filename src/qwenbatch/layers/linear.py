"""oneDNN linear layers with prepacked weights, on CPU: float32 everywhere, bfloat16 where the CPU
multiplies it natively (AVX512-BF16 or AMX).

With a weight reordered once into its blocked layout, oneDNN runs the skinny matmuls of decoding
faster than ``F.linear``: float32 on the AVX2 kind, at batch 16, 896 -> 9728 from 30 to 95 GFLOP/s;
bfloat16 on the AVX512-BF16 kind 3.6x at one row (bandwidth-bound: 38 GB/s of weights against 10),
1.3x at 16 and 1.2x at 64 rows (BENCHMARKS.md). In float32 its rows are also bitwise independent of
the batch size, which ``F.linear`` does not promise.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing is used on CPU for float32, and for bfloat16 where the CPU has native bf16 matmuls
    (measured faster than ``F.linear`` at every batch size there); never for float16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


# Rows of x are cut into pieces of at most PIECE_ROWS where a linear's ``pieces_at`` holds their bucket: the
# multiple of BUCKET_ROWS nearest the row count (layers/packed_rows.py times which).
PIECE_ROWS = 384
BUCKET_ROWS = 256


def row_bucket(rows: int) -> int:
    """The multiple of BUCKET_ROWS nearest ``rows``."""
    return round(rows / BUCKET_ROWS) * BUCKET_ROWS


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout. Row counts whose bucket is in ``pieces_at``
    run as pieces of at most PIECE_ROWS rows, where oneDNN would run the whole on one thread."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.pieces_at: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces_at and x.dim() == 2 and row_bucket(x.shape[0]) in self.pieces_at:
            return self.pieces_forward(x)
        return self.whole_forward(x)

    def whole_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def pieces_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product on pieces of at most PIECE_ROWS rows of the 2-D ``x``, as even as they come."""
        rows = x.shape[0]
        count = -(-rows // PIECE_ROWS)
        bounds = [rows * i // count for i in range(count + 1)]
        return torch.cat([self.whole_forward(x[a:b]) for a, b in itertools.pairwise(bounds)])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], keep=lambda linear: False) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but those ``keep`` says to leave) by ``make(linear)``;
    returns how many. The dense weights are released as they go (a tied LM head keeps the embedding)."""
    # Names, not modules: holding the modules would keep every dense weight alive until the end.
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not keep(m)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))
    return len(names)


def pack_linears(model: nn.Module, keep=lambda linear: False) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but those ``keep`` says to leave) by a PackedLinear; returns
    how many were replaced."""
    count = replace_linears(model, PackedLinear, keep)
    logger.info("packed %d linear layers for oneDNN", count)
    return count
