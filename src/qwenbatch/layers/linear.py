"""oneDNN linear layers with prepacked weights, for float32 on CPU.

On the 2-core AVX2 machines we run on, oneDNN with a weight reordered once into its blocked
layout runs the skinny matmuls of decoding 1.5-3x faster than ``F.linear`` (MKL): at batch 16,
896 -> 9728 goes from 30 to 95 GFLOP/s (BENCHMARKS.md). Its rows are also bitwise independent
of the batch size, which ``F.linear`` does not promise.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing is used for float32 on CPU (the only case measured here)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a PackedLinear; returns how many were replaced.

    The dense weights are released as they go (a tied LM head keeps the embedding it shares).
    """
    # Names, not modules: holding the modules would keep every dense weight alive until the end.
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(getattr(parent, child)))
    logger.info("packed %d linear layers for oneDNN", len(names))
    return len(names)
