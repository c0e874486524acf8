"""Which kernel runs prefill attention on this CPU, chosen at load by timing both on the model's head shape.

The CPU's flags cannot settle it. Our bf16 kernel (csrc/prefill_attention.cpp) ran 4-6x SDPA's CPU flash kernel on
AMD's AVX512-BF16 CPUs in vdpbf16ps register tiles (benchmarks/prefill_attention_micro.py). SDPA's kernel hands
its bf16 block products to oneDNN, which runs them in AMX tiles where the CPU has AMX, as ours then does too; its
float32 ones to MKL, against our AVX2 FMA tiles (csrc/prefill_attention_f32.cpp), which on an AVX-512 CPU run at
half its vector width. Which one is faster is a measurement, made here in a few tens of milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenbatch.layers.attention import sdpa_chunk_attention
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.timing import best_times_ms

OURS = "cpu-kernels"
SDPA = "sdpa-flash"
# One fresh prompt of this many tokens is timed: the scheduler's chunks on CPU are of this order, and the two
# kernels' ratio moves little with length (4.9x at 1,024 tokens, 4.4x at 4,096 on 8,192 keys, Zen 5).
TIMED_TOKENS = 1024


@dataclass(frozen=True)
class PrefillAttentionChoice:
    """The kernel that runs prefill attention, and the timings (ms, best of a few) that chose it, if any."""

    kernel: str  # OURS or SDPA
    ours_ms: float | None = None
    sdpa_ms: float | None = None
    tokens: int = TIMED_TOKENS
    ours_isa: str = ""  # what our kernel took its products with where timed: "amx", "avx512-bf16" or "avx2-fma"

    def describe(self) -> str:
        ours = f"{OURS} ({self.ours_isa})" if self.ours_isa else OURS
        chosen = ours if self.kernel == OURS else self.kernel
        if self.ours_ms is None or self.sdpa_ms is None:
            return chosen
        return f"{chosen} (timed on {self.tokens} tokens: {ours} {self.ours_ms:.1f} ms, {SDPA} {self.sdpa_ms:.1f} ms)"


SDPA_UNTIMED = PrefillAttentionChoice(SDPA)  # where ours cannot run, or the CPU kernels are off


# The head_dim each dtype's kernel takes a multiple of: its register tiles' widths.
_HEAD_DIM_STEP = {torch.bfloat16: 32, torch.float32: 16}


def our_isa(dtype: torch.dtype) -> str:
    """What our kernel takes its products with in ``dtype`` on this CPU ("amx", "avx512-bf16" or "avx2-fma"), or ""
    where it was not built for it: bf16 needs AVX512-BF16, float32 AVX2 and FMA."""
    if dtype not in _HEAD_DIM_STEP:
        return ""
    return kernels().prefill_attention_isa(str(dtype).removeprefix("torch."))


def ours_can_run(dtype: torch.dtype, head_dim: int) -> bool:
    """Our kernel takes bf16 with a head_dim that is a multiple of 32 and float32 with one of 16, where built."""
    return dtype in _HEAD_DIM_STEP and head_dim % _HEAD_DIM_STEP[dtype] == 0 and bool(our_isa(dtype))


def choose_prefill_attention(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tokens: int = TIMED_TOKENS,
    repeats: int = 3,
) -> PrefillAttentionChoice:
    """Time our kernel and SDPA's flash kernel on one causal prompt of ``tokens`` tokens with the model's heads
    (after a warm-up call each, alternating, best of ``repeats``) and pick the faster. Where ours cannot run,
    SDPA, untimed."""
    if not ours_can_run(dtype, head_dim):
        return SDPA_UNTIMED
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    candidates = {
        OURS: lambda: kernels().prefill_attention(q, k, v, scale),
        SDPA: lambda: sdpa_chunk_attention(q, k, v, scale),
    }
    best = best_times_ms(candidates, repeats)
    kernel = OURS if best[OURS] <= best[SDPA] else SDPA
    return PrefillAttentionChoice(kernel, best[OURS], best[SDPA], tokens, our_isa(dtype))
