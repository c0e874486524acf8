"""Int8 linear layers on CPU (``--quantization int8``): int8 weights with one scale per 32 weights,
activations quantized per 32 values on the fly, integer dot products (AVX-512 VNNI, or AVX2).

A decode step at batch 1 reads every weight once, so it is bound by memory: int8 halves bfloat16's
bytes. With VNNI one instruction multiplies-adds 64 int8 pairs, so the same kernel also outruns
oneDNN's bfloat16 at large M (BENCHMARKS.md: 2.4x at one row, 1.3x at 256 rows on the AVX-512 BF16
kind). The kernel is ``csrc/int8_linear.cpp``, built by ``layers/cpu_kernels.py``.

Quantization is symmetric, per group of 32 along the input dimension (GGUF's Q8_0 and Q5_0 blocks): a group
dequantized from Q8_0 or Q5_0 is held exactly; others round to the nearest of 255 levels of their group. The
weights must come in float32 for that (a bfloat16 copy has already rounded them): the loader re-reads each one
from the checkpoint as its layer is quantized. A tensor whose every group is a Q5_0 block (the default model's
gate/up and attention output) is stored in 5 bits where a SIMD kernel widens them (AVX-512 VNNI or AVX2): a
batch-1 decode step is bound by the bytes it reads, and on AVX2 the 5-bit products also skip the sign trick
8-bit weights need and sum in int16 four chunks at a time (BENCHMARKS.md, AVX2 kind: 1.36x the 8-bit layout at
one row, 1.10-1.36x from 4 rows up). A gated MLP's gate_up also applies SiLU(gate) * up as it stores its results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.huge_pages import HugePageArena
from qwenbatch.layers.linear import replace_linears

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # weights per scale
TILE_ROWS = 16  # the kernel's packed layout keeps output rows in tiles of this many
_ROWS_PER_SLICE = 4096  # a multiple of TILE_ROWS: slices pack independently


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K a multiple of 32) -> (int8 values [N, K], float16 scales [N, K / 32]), symmetric
    per group of 32: scale = max |w| / 127, rounded to float16 before the values are rounded to it (Q8_0's
    rule) -- except groups that Q5_0's rule (``quantize_weight_q5``) holds exactly, which keep its values.

    The reference: layers quantize with the kernel module's ``quantize_groups`` (one pass in C++, tested equal)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = (groups.abs().amax(-1) / 127).half()
    s = scales.float().unsqueeze(-1)
    values = torch.where(s > 0, torch.round(groups / s.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    values = values.clamp(-127, 127).to(torch.int8).reshape(n, k)
    q5_values, q5_scales = quantize_weight_q5(weight)
    q5_groups = exact_groups(weight, q5_values, q5_scales).unsqueeze(-1)
    values = torch.where(q5_groups, q5_values.reshape(groups.shape), values.reshape(groups.shape)).reshape(n, k)
    return values, torch.where(q5_groups.squeeze(-1), q5_scales, scales)


@torch.no_grad()
def quantize_weight_q5(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q5_0 rule: per group of 32, scale d = -(the value of largest magnitude) / 16 in float16, values
    round(w / d) clamped to [-16, 15]. On a tensor dequantized from Q5_0 this gives back its blocks exactly."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    scales = (-extreme / 16).half().squeeze(-1)
    d = scales.float().unsqueeze(-1)
    values = torch.where(d != 0, torch.round(groups / torch.where(d != 0, d, 1.0)), 0.0)
    return values.clamp(-16, 15).to(torch.int8).reshape(n, k), scales


def exact_groups(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K / 32] bool: which groups ``values`` and ``scales`` stand for without any rounding."""
    n, k = weight.shape
    return (dequantize(values, scales) == weight.float()).reshape(n, k // GROUP_SIZE, GROUP_SIZE).all(-1)


def is_exact(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``values`` and ``scales`` stand for ``weight`` without any rounding."""
    return bool(exact_groups(weight, values, scales).all())


def pack(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: rows in tiles of 16; per tile and 4 consecutive inputs, the 16 rows' 4 bytes
    side by side, as ``value + 128`` (uint8); scales per tile, group, row. N must be a multiple of 16."""
    n, k = values.shape
    tiles = n // TILE_ROWS
    packed = (values.to(torch.int16) + 128).to(torch.uint8)
    packed = packed.reshape(tiles, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)
    return packed, _pack_scales(scales)


def _pack_scales(scales: torch.Tensor) -> torch.Tensor:
    n, groups = scales.shape
    return scales.reshape(n // TILE_ROWS, TILE_ROWS, groups).permute(0, 2, 1).contiguous().reshape(-1)


def pack_q5(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's 5-bit layout of values in [-16, 15], per tile of 16 rows and group of 32 inputs (320
    bytes): the low nibbles of ``value + 16`` for the group's 8 chunks of ``pack``'s layout (64 bytes per two
    chunks, the first in the low nibble), then each chunk's fifth bits (8 bytes, bit b for byte b). Scales
    as ``pack``'s. N must be a multiple of 16."""
    n, k = values.shape
    tiles, groups = n // TILE_ROWS, k // GROUP_SIZE
    u5 = (values.to(torch.int16) + 16).to(torch.uint8)
    chunks = u5.reshape(tiles, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(tiles, groups, 8, 64)
    nibbles = (chunks[:, :, 0::2] & 0x0F) | ((chunks[:, :, 1::2] & 0x0F) << 4)  # [tiles, groups, 4, 64]
    bit_weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    fifth = ((chunks >> 4) & 1).reshape(tiles, groups, 8, 8, 8)
    high = (fifth * bit_weights).sum(-1, dtype=torch.int32).to(torch.uint8)  # [tiles, groups, 8, 8]
    packed = torch.cat([nibbles.reshape(tiles, groups, 256), high.reshape(tiles, groups, 64)], dim=2)
    return packed.reshape(-1), _pack_scales(scales)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight that ``values`` and ``scales`` stand for (the reference the kernel is tested against)."""
    n, k = values.shape
    return (values.float().reshape(n, -1, GROUP_SIZE) * scales.float().unsqueeze(-1)).reshape(n, k)


def interleave_gate_up(n: int) -> torch.Tensor:
    """The row order of a gated MLP's gate_up ([gate; up], ``n`` rows) that the kernel's SiLU(gate) * up takes:
    each tile of 16 rows holds 8 rows of the gate, then the same 8 of up."""
    return torch.arange(n).reshape(2, n // TILE_ROWS, TILE_ROWS // 2).transpose(0, 1).reshape(-1)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as packed int8, or 5-bit where it is Q5_0-exact and ``five_bit``
    (rows padded to a multiple of 16). With ``silu_and_mul``, ``linear`` is a gated MLP's gate_up ([gate; up],
    a multiple of 16 rows) and the layer returns SiLU(gate) * up, computed as each tile's results are stored:
    SiluAndMul's rounding, without its pass over the [M, 2 * intermediate] result.

    From ``dense_from_rows`` rows of bfloat16 x on (None: never), the product runs instead as a dense bf16 matmul
    on the weight dequantized for the call (``dense_forward``): where oneDNN has AMX, it can outrun the int8 kernel
    at a prefill chunk's rows. ``layers/int8_large_m.py`` times both at load and sets it."""

    dense_from_rows: int | None = None

    def __init__(
        self,
        linear: nn.Linear,
        five_bit: bool = False,
        read_rows: Callable[[int, int], torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
        silu_and_mul: bool = False,
    ) -> None:
        """``read_rows(start, stop)`` and ``bias``: those rows of ``linear``'s weight, and its bias, as the
        checkpoint holds them (float32) when ``linear`` holds a rounded copy; by default ``linear``'s own."""
        super().__init__()
        if silu_and_mul and linear.out_features % TILE_ROWS:
            raise ValueError(f"silu_and_mul needs a multiple of {TILE_ROWS} rows, not {linear.out_features}")
        self.silu_and_mul = silu_and_mul
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if silu_and_mul else linear.out_features
        self.padded_out = -(-linear.out_features // TILE_ROWS) * TILE_ROWS  # rows as packed
        if read_rows is None:
            read_rows = lambda start, stop: linear.weight.detach()[start:stop]  # noqa: E731
        self._kernels = kernels()
        # In slices of rows, each read when it is quantized: the float32 temporaries of a 151,936-row LM head
        # would otherwise add GBs to the peak. Every group a Q5_0 block: 5 bits where ``five_bit``.
        quantized, self.q5_exact, self.exact = [], True, True
        for start in range(0, self.padded_out, _ROWS_PER_SLICE):
            stop = min(start + _ROWS_PER_SLICE, self.padded_out)
            weight = read_rows(start, min(stop, linear.out_features)).float()
            weight = F.pad(weight, (0, 0, 0, stop - start - weight.shape[0]))  # rows up to a multiple of 16
            values, scales, q5, exact = self._kernels.quantize_groups(weight)
            self.q5_exact &= bool(q5.all())
            self.exact &= bool(exact.all())
            quantized.append((values, scales))
        if silu_and_mul:
            order = interleave_gate_up(self.padded_out)
            quantized = [(torch.cat([v for v, _ in quantized])[order], torch.cat([sc for _, sc in quantized])[order])]
        self.bits = 5 if five_bit and self.q5_exact else 8
        parts = [(pack_q5 if self.bits == 5 else pack)(values, scales) for values, scales in quantized]
        self.packed_weight = torch.cat([w for w, _ in parts])
        self.packed_scales = torch.cat([sc for _, sc in parts])
        if bias is None and linear.bias is not None:
            bias = linear.bias.detach()
        bias = None if bias is None else bias.float()
        if bias is not None and self.padded_out != linear.out_features:
            bias = F.pad(bias, (0, self.padded_out - linear.out_features))
        # For dense_forward: in [gate; up] order, rounded to bf16 as a bf16 checkpoint's bias is.
        self._dense_bias = None if bias is None else bias.bfloat16()
        if bias is not None and silu_and_mul:
            bias = bias[interleave_gate_up(self.padded_out)]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.dense_from_rows is not None and len(rows) >= self.dense_from_rows and rows.dtype == torch.bfloat16:
            y = self.dense_forward(rows)
        else:
            y = self.kernel_forward(rows)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``rows`` [M, in_features] in the int8 kernel: ``padded_out`` columns (SiLU(gate) *
        up's half of them with ``silu_and_mul``)."""
        return self._kernels.int8_linear(
            rows, self.packed_weight, self.packed_scales, self.bias, self.padded_out, self.bits, self.silu_and_mul
        )

    def dense_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``rows`` [M, in_features] (bfloat16) through its weight dequantized to bfloat16
        and PyTorch's dense matmul: ``padded_out`` columns, or SiLU(gate) * up's half rounded as SiluAndMul."""
        weight_t = self._kernels.int8_dequantize(
            self.packed_weight, self.packed_scales, self.padded_out, self.in_features, self.bits, self.silu_and_mul
        )
        bias = self._dense_bias
        y = torch.matmul(rows, weight_t) if bias is None else torch.addmm(bias, rows, weight_t)
        return self._kernels.silu_and_mul(y) if self.silu_and_mul else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, silu_and_mul={self.silu_and_mul}"
        )


def int8_supported(linear: nn.Linear) -> bool:
    """The kernel needs the input size to be a multiple of 32 (every Qwen2/Qwen3 linear is)."""
    return linear.in_features % GROUP_SIZE == 0


def _gated_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLPs whose ``act_fn`` is SiLU(gate) * up of a ``gate_up_proj`` the kernel can fuse it into."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "act_fn", None), SiluAndMul)
        and isinstance(getattr(m, "gate_up_proj", None), nn.Linear)
        and int8_supported(m.gate_up_proj)
        and m.gate_up_proj.out_features % TILE_ROWS == 0
    ]


def five_bit_available() -> bool:
    """Whether Q5_0-exact weights are held in 5 bits: the SIMD kernels widen them in registers; the portable
    kernel's plain loops would pay more than the bytes save."""
    return kernels().isa() != "portable"


def quantize_linears(model: nn.Module, exact_weight: Callable[[str, int, int], torch.Tensor] | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` the kernel supports by an Int8Linear; returns how many. A gated
    MLP's gate_up computes its SiLU(gate) * up too, and the MLP's ``act_fn`` becomes the identity.

    ``exact_weight(name, start, stop)`` gives rows of a parameter of ``model`` (by its name) as the checkpoint
    holds them, in float32: the layers quantize from them, a slice at a time, when the model was loaded in a
    narrower dtype. Without it they quantize from the model's own weights.
    """
    module = kernels()  # build before the first layer, so a missing compiler fails fast
    five_bit = five_bit_available()
    # By identity, so a tied LM head finds the embedding's name (the only name its weight has).
    param_names = {id(param): name for name, param in model.named_parameters()}
    gated_mlps = _gated_mlps(model)
    gated = {id(m.gate_up_proj) for m in gated_mlps}

    def make(linear: nn.Linear) -> Int8Linear:
        fused = id(linear) in gated
        if exact_weight is None:
            return Int8Linear(linear, five_bit, silu_and_mul=fused)
        name = param_names[id(linear.weight)]
        bias = None if linear.bias is None else exact_weight(param_names[id(linear.bias)], 0, linear.out_features)
        return Int8Linear(linear, five_bit, lambda start, stop: exact_weight(name, start, stop), bias, fused)

    count = replace_linears(model, make, keep=lambda linear: not int8_supported(linear))
    for mlp in gated_mlps:
        mlp.act_fn = nn.Identity()
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # In the order the layers run, each old copy freed as its new one is made.
    arena = HugePageArena.for_tensors([t for m in layers for t in (m.packed_weight, m.packed_scales)])
    for m in layers:
        m.packed_weight, m.packed_scales = arena.place(m.packed_weight), arena.place(m.packed_scales)
    logger.info(
        "quantized %d linear layers to int8 (%s kernel): %d hold their weights exactly (Q8_0 / Q5_0 blocks), "
        "%d in 5 bits; packed weights in one mapping, 2 MiB pages %s",
        count,
        module.isa(),
        sum(m.exact for m in layers),
        sum(m.bits == 5 for m in layers),
        "requested" if arena.huge_pages else "unavailable",
    )
    return count
