"""Our CPU kernels (``csrc/``): the int8 linear and the fused small-step ops, compiled on first use.

One extension module, built by torch's C++ extension builder with ``-march=native`` for the CPU it runs
on (~1 min once on 2 cores, then loaded from torch's extension cache, ~/.cache/torch_extensions); it needs a C++
compiler. The module name carries a hash of the CPU's flags and of the sources, so a cache shared by
machines of different kinds never loads a binary built for another, nor an old build of changed sources.
A build killed half-way (a Ctrl-C during a first start) is taken up again by the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.norm import RMSNorm
from qwenbatch.layers.rotary import Rope, RotaryEmbedding
from qwenbatch.layers.sampler import RowPenalties, RowSettings

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (
    "bindings.cpp",
    "int8_linear.cpp",
    "dequantize.cpp",
    "quantize.cpp",
    "cpu_ops.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "prefill_attention_f32.cpp",
    "decode_layer.cpp",
    "host_allocator.cpp",
    "sampling.cpp",
    "logprobs.cpp",
)
# Float operations may be assumed not to trap (no value changes): without it GCC will not turn a comparison into a
# blend where it has no masked instructions, and with AVX2 only every loop calling qb::vec_exp (SiLU, softmax)
# stayed scalar ("control flow in loop"), while AVX-512 builds vectorized them (tests/test_cpu_kernels.py checks).
_CODEGEN = "-fno-trapping-math"
# Vectorized loops as wide as the CPU's registers. GCC's tuning for Intel's AVX-512 cores prefers 256-bit vectors
# (on the AMX kind here, -march=native tunes for Rocket Lake), so every loop it vectorized (SiLU * up, the norms,
# the softmax, the conversions) ran in half-width registers while the intrinsics beside them were 512-bit wide:
# silu_and_mul took 1.86 cycles an output, 1.33 with 512-bit vectors. No effect where the CPU lacks AVX-512.
_VECTOR_WIDTH = "-mprefer-vector-width=512"
# -march per build target; "native" is what the engine uses, the others let tests check every code path here
# ("avx512": AVX-512 without VNNI or BF16, as on Skylake servers; runnable only on an AVX-512 CPU; "no-amx": this
# CPU without its AMX tiles, the AVX512-BF16 kinds' code where both run).
_TARGETS = {
    "native": "-march=native",
    "no-amx": "-march=native -mno-amx-tile -mno-amx-bf16 -mno-amx-int8",
    "avx2": "-march=x86-64-v3",
    "portable": "-march=x86-64-v2",
    "avx512": "-march=skylake-avx512",
}


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Held while torch builds or loads the module in ``build_dir``. torch's own lock there is a file, which a
    build killed half-way leaves behind, and torch then waits on it forever at every later start. Ours is an
    flock, released by the kernel when its holder dies: while we hold it no build can be running, so a torch
    lock left in the directory is stale and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "qwenbatch.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def kernels(target: str = "native"):
    """The compiled module. ``native`` builds for this CPU (the int8 linear's VNNI kernel where the CPU
    has AVX-512 VNNI, else its AVX2 one, else plain loops; the decode attention's scores on AMX tiles where it has
    them); ``avx2``, ``portable``, ``avx512`` and ``no-amx`` force others."""
    return build(_CSRC, target)


def build(csrc: Path, target: str = "native"):
    """The module built from the sources in ``csrc`` (a copy of ``csrc/`` as another commit had it, for
    benchmarks that run two versions of the kernels side by side in one process), or loaded from the cache."""
    from torch.utils.cpp_extension import get_default_build_root, load

    # The sources and flags are in the key too: torch rebuilds when a .cpp changes, but not when only a header does.
    sources = b"".join(path.read_bytes() for path in sorted(csrc.iterdir()))
    flags = ["-O3", "-fopenmp", _CODEGEN, _VECTOR_WIDTH, *_TARGETS[target].split()]
    machine = " ".join(sorted(cpu_flags())) if "native" in _TARGETS[target] else ""
    key = hashlib.sha256(" ".join([machine, *flags]).encode() + sources).hexdigest()[:12]
    name = f"qwenbatch_cpu_kernels_{key}"
    build_dir = Path(get_default_build_root()) / name
    started = time.perf_counter()
    try:
        with _build_lock(build_dir):
            module = load(
                name=name,
                # an older commit's copy of csrc/ may lack some of today's sources
                sources=[str(csrc / source) for source in _SOURCES if (csrc / source).exists()],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch has loaded: one OpenMP pool
                build_directory=str(build_dir),
            )
    except (RuntimeError, OSError, ImportError) as e:
        raise RuntimeError(f"qwenbatch's CPU kernels need a C++ compiler to build (g++): {e}") from e
    logger.info(
        "CPU kernels (%s, int8 linear: %s, decode attention: %s) ready in %.1f s",
        target,
        module.isa(),
        module.decode_attention_isa(),
        time.perf_counter() - started,
    )
    return module


class KernelRMSNorm(RMSNorm):
    """RMSNorm in one kernel call, the residual add before it too, with the layer's rounding steps (its float32 sum
    is taken in another order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels().rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return kernels().add_rms_norm(x, residual, self.weight, self.eps)


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
    logits in their own dtype: the sampler's ``SamplerKernels.greedy`` (layers/sampler.py)."""
    tokens, non_finite = kernels().greedy_tokens(logits)
    return tokens.tolist(), non_finite.tolist()


def mask_to_allowed(logits: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """A copy of ``logits`` [R, vocab] where each row keeps the logits of the tokens its ``bits`` allow (int32
    [R, words]: bit t % 32 of word t // 32) and -inf elsewhere, and whether the row itself holds an inf or a NaN, in
    one read: the sampler's ``SamplerKernels.mask`` (layers/sampler.py)."""
    masked, non_finite = kernels().mask_to_allowed(logits, bits)
    return masked, non_finite.tolist()


def sample_tokens(
    logits: torch.Tensor, settings: RowSettings, penalties: RowPenalties
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token drawn by the inverse CDF at its uniform number after its penalties, temperature, top-k, top-p
    and min-p (at temperature 0: its argmax), as the sampler's PyTorch path picks it, in a few vector passes over
    each row rather than a sort; and whether the row itself holds an inf or a NaN: the sampler's
    ``SamplerKernels.sample`` (layers/sampler.py). Logits [R, vocab] in any float dtype."""
    s, p = settings, penalties
    return kernels().sample_tokens(
        logits,
        s.temperature,
        s.top_k,
        s.top_p,
        s.min_p,
        s.uniform,
        p.repetition,
        p.presence,
        p.frequency,
        p.prompt_starts,
        p.prompt_ids,
        p.output_starts,
        p.output_ids,
        p.suppressed_starts,
        p.suppressed_ids,
    )


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``targets`` token's log-probability and rank (1 + how many logits are larger), and its ``k`` largest
    logits as log-probabilities (best first, ties by the lower id) with their ids, read from logits [R, vocab] in their
    own dtype: the sampler's ``SamplerKernels.logprobs``."""
    return kernels().token_logprobs(logits, targets, k)


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
