"""Int8 linear layers on CPU (``--quantization int8``): int8 weights with one scale per 32 weights,
activations quantized per 32 values on the fly, integer dot products (AVX-512 VNNI, or AVX2).

A decode step at batch 1 reads every weight once, so it is bound by memory: int8 halves bfloat16's
bytes. With VNNI one instruction multiplies-adds 64 int8 pairs, so the same kernel also outruns
oneDNN's bfloat16 at large M (BENCHMARKS.md: 2.4x at one row, 1.3x at 256 rows on the AVX-512 BF16
kind). The kernel is ``csrc/int8_linear.cpp``, built by ``layers/cpu_kernels.py``.

Quantization is symmetric, per group of 32 along the input dimension (GGUF's Q8_0 block): a Q8_0
tensor is held exactly; others round to the nearest of 255 levels of their group.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.linear import replace_linears

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # weights per scale
TILE_ROWS = 16  # the kernel's packed layout keeps output rows in tiles of this many
_ROWS_PER_SLICE = 4096  # a multiple of TILE_ROWS: slices pack independently


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K a multiple of 32) -> (int8 values [N, K], float16 scales [N, K / 32]), symmetric
    per group of 32: scale = max |w| / 127, rounded to float16 before the values are rounded to it."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = (groups.abs().amax(-1) / 127).half()
    s = scales.float().unsqueeze(-1)
    values = torch.where(s > 0, torch.round(groups / s.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    return values.clamp(-127, 127).to(torch.int8).reshape(n, k), scales


def pack(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: rows in tiles of 16; per tile and 4 consecutive inputs, the 16 rows' 4 bytes
    side by side, as ``value + 128`` (uint8); scales per tile, group, row. N must be a multiple of 16."""
    n, k = values.shape
    tiles = n // TILE_ROWS
    packed = (values.to(torch.int16) + 128).to(torch.uint8)
    packed = packed.reshape(tiles, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)
    packed_scales = scales.reshape(tiles, TILE_ROWS, k // GROUP_SIZE).permute(0, 2, 1).contiguous().reshape(-1)
    return packed, packed_scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight that ``values`` and ``scales`` stand for (the reference the kernel is tested against)."""
    n, k = values.shape
    return (values.float().reshape(n, -1, GROUP_SIZE) * scales.float().unsqueeze(-1)).reshape(n, k)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as packed int8 (rows padded to a multiple of 16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.padded_out = -(-self.out_features // TILE_ROWS) * TILE_ROWS
        if self.padded_out != self.out_features:
            weight = F.pad(weight, (0, 0, 0, self.padded_out - self.out_features))
        # In slices of rows: the float32 temporaries of a 151,936-row LM head would otherwise add GBs to the peak.
        parts = [
            pack(*quantize_weight(weight[i : i + _ROWS_PER_SLICE])) for i in range(0, self.padded_out, _ROWS_PER_SLICE)
        ]
        self.packed_weight = torch.cat([w for w, _ in parts])
        self.packed_scales = torch.cat([sc for _, sc in parts])
        bias = None if linear.bias is None else linear.bias.detach().float()
        if bias is not None and self.padded_out != self.out_features:
            bias = F.pad(bias, (0, self.padded_out - self.out_features))
        self.bias = bias
        self._kernels = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self._kernels.int8_linear(rows, self.packed_weight, self.packed_scales, self.bias, self.padded_out)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_supported(linear: nn.Linear) -> bool:
    """The kernel needs the input size to be a multiple of 32 (every Qwen2/Qwen3 linear is)."""
    return linear.in_features % GROUP_SIZE == 0


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` the kernel supports by an Int8Linear; returns how many."""
    module = kernels()  # build before the first layer, so a missing compiler fails fast
    count = replace_linears(model, Int8Linear, keep=lambda linear: not int8_supported(linear))
    logger.info("quantized %d linear layers to int8 (%s kernel)", count, module.isa())
    return count
