"""Load-time layout of a model's layers for the CPU it runs on: int8 or oneDNN-prepacked linears, and the
fused CPU kernels. Done once after the weights are loaded, so the model runner only runs what it is given."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qwenbatch.layers.linear import onednn_available, pack_linears


@dataclass(frozen=True)
class ModelKernels:
    """What ``prepare_kernels`` chose; ``linear_kernels`` is recorded in the log and in bench JSON."""

    linear_kernels: str  # e.g. "torch", "onednn-prepacked-bfloat16", "int8-avx512vnni"
    cpu_kernels: bool  # norms, SiLU * up, RoPE and decode attention run in layers/csrc (the int8 path)


def prepare_kernels(model: nn.Module, dtype: torch.dtype, device: torch.device, quantization: str) -> ModelKernels:
    """Swap ``model``'s layers in place for the fastest kernels this CPU has (nothing changes on CUDA).

    int8 runs on our CPU kernels (layers/cpu_kernels.py), and so, once they are built, do the norms,
    SiLU * up and decode attention (a batch-1 step is otherwise half PyTorch per-op overhead). Linears that
    stay dense are prepacked for oneDNN where it has a fast path for ``dtype``.
    """
    linear_kernels = "torch"
    cpu_kernels = quantization == "int8"
    if cpu_kernels:
        from qwenbatch.layers.cpu_kernels import kernels, use_cpu_kernels
        from qwenbatch.layers.int8_linear import quantize_linears

        quantize_linears(model)
        use_cpu_kernels(model)
        linear_kernels = f"int8-{kernels().isa()}"
    if onednn_available(dtype, device) and pack_linears(model):  # what int8 left dense, or every linear
        packed = f"onednn-prepacked-{str(dtype).removeprefix('torch.')}"
        linear_kernels = packed if quantization == "none" else f"{linear_kernels}+{packed}"
    return ModelKernels(linear_kernels, cpu_kernels)
