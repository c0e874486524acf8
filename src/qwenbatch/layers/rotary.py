"""Rotary position embeddings (the "neox" half-rotation layout Qwen uses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to packed queries and keys given each token's absolute position.

    The cos/sin table is computed in float32 and grown on demand (``reserve``), so a 262k-position
    model pays only for the positions it actually sees.
    """

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def reserve(self, length: int, device: torch.device) -> None:
        """Make the table cover positions [0, length) on ``device``; the runner calls this before a step,
        from positions it knows on the host, so ``forward`` never reads a device value (CUDA graphs)."""
        if self._cos.shape[0] >= length and same_device(self._cos.device, device):
            return
        size = max(length, 2 * self._cos.shape[0], 4096)
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim)
        )
        freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The packed tokens' cos and sin (positions covered by ``reserve``), computed once per step and
        shared by every layer."""
        return Rope(self._cos[positions].to(dtype)[:, None, :], self._sin[positions].to(dtype)[:, None, :])


def same_device(have: torch.device, want: torch.device) -> bool:
    """Whether a tensor on ``have`` is on ``want``, where a CUDA device without an index means the current
    one. (``torch.device("cuda") != torch.device("cuda:0")``, the device of every tensor on it: compared
    plainly, the table was rebuilt at double its size every step, freeing the one CUDA graphs had captured.)"""
    want = torch.device(want)
    if have.type != want.type:
        return False
    if want.type == "cuda":
        return have.index == (torch.cuda.current_device() if want.index is None else want.index)
    return have.index is None or want.index is None or have.index == want.index


@dataclass
class Rope:
    """One step's rotary tables: cos and sin ``[T, 1, head_dim]``; ``apply`` rotates queries and keys."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, self.cos, self.sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; cos/sin from RotaryEmbedding."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
