"""Our CPU kernels (``csrc/``): the int8 linear and the fused small-step ops, compiled on first use.

One extension module, built by torch's C++ extension builder with ``-march=native`` for the CPU it runs
on (~60 s once, then loaded from torch's extension cache, ~/.cache/torch_extensions); it needs a C++
compiler. The module name carries a hash of the CPU's flags and of the sources, so a cache shared by
machines of different kinds never loads a binary built for another, nor an old build of changed sources.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.norm import RMSNorm
from qwenbatch.layers.rotary import Rope, RotaryEmbedding

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (
    "bindings.cpp",
    "int8_linear.cpp",
    "quantize.cpp",
    "cpu_ops.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "decode_layer.cpp",
)
# -march per build target; "native" is what the engine uses, the others let tests check every code path here.
_TARGETS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64-v2"}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def kernels(target: str = "native"):
    """The compiled module. ``native`` builds for this CPU (the int8 linear's VNNI kernel where the CPU
    has AVX-512 VNNI, else its AVX2 one, else plain loops); ``avx2`` and ``portable`` force the others."""
    from torch.utils.cpp_extension import load

    # The sources are in the key too: torch rebuilds when a .cpp changes, but not when only a header does.
    sources = b"".join(path.read_bytes() for path in sorted(_CSRC.iterdir()))
    key = hashlib.sha256((_cpu_flags() if target == "native" else target).encode() + sources).hexdigest()[:12]
    started = time.perf_counter()
    try:
        module = load(
            name=f"qwenbatch_cpu_kernels_{key}",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=["-O3", "-fopenmp", _TARGETS[target]],
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch has loaded: one OpenMP pool
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise RuntimeError(f"qwenbatch's CPU kernels need a C++ compiler to build (g++): {e}") from e
    logger.info(
        "CPU kernels (%s, int8 linear: %s) ready in %.1f s", target, module.isa(), time.perf_counter() - started
    )
    return module


class KernelRMSNorm(RMSNorm):
    """RMSNorm in one kernel call, with the layer's rounding steps (its float32 sum is taken in another order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels().rms_norm(x, self.weight, self.eps)


class KernelSiluAndMul(SiluAndMul):
    """SiLU(gate) * up in one kernel call, with the layer's rounding steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels().silu_and_mul(x)


class KernelRope(Rope):
    """Rotates queries and keys in one kernel call each, with the PyTorch expression's rounding steps."""

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        module = kernels()
        return module.rotary(q, self.cos, self.sin), module.rotary(k, self.cos, self.sin)


class KernelRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose tables rotate through the kernel."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        rope = super().forward(positions, dtype)
        return KernelRope(rope.cos, rope.sin)


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's argmax (the first maximal index) and whether the row holds an inf or a NaN, in one read of the
    logits in their own dtype: the sampler's ``greedy_kernel`` (layers/sampler.py)."""
    tokens, non_finite = kernels().greedy_tokens(logits)
    return tokens.tolist(), non_finite.tolist()


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap ``model``'s RMSNorm, SiluAndMul and RotaryEmbedding modules for their kernel-calling
    subclasses; returns how many.

    Parameters stay where they are (the same tensors), so this may run before or after loading.
    """
    kernels()  # build first, so a missing compiler fails before anything changes
    swaps = {RMSNorm: KernelRMSNorm, SiluAndMul: KernelSiluAndMul, RotaryEmbedding: KernelRotaryEmbedding}
    count = 0
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
            count += 1
    return count
