"""SwiGLU's activation: SiLU(gate) * up over a fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``x[..., :n]`` is the gate, ``x[..., n:]`` the up projection; returns SiLU(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
