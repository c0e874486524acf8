"""PyTorch's CPU allocator for an engine's step buffers: large freed buffers are kept and reused, not unmapped.

PyTorch allocates CPU tensors with malloc. glibc serves each buffer above 32 MiB with a fresh ``mmap`` and unmaps
it when freed, and in a thread's own arena (the engine's thread in a server or a run-batch job) it does so for
every buffer larger than its heap. A prefill chunk's activations are such buffers (2,048 tokens' gate_up output is
40 MB in bfloat16), so every chunk of every layer faulted its pages in again and the kernel zeroed them: 12% of
the cpu-mixed workload's prefill went to page faults (perf, BENCHMARKS.md, issue 15). The CPU kernels' allocator
(``csrc/host_allocator.cpp``), installed by every CPU engine whose kernels may be built (float32 ones too: it changes
no value), maps the buffers malloc would map (32 MiB and more) as whole 2 MiB pages and caches
them when freed, up to ``CACHE_LIMIT_BYTES``, for the next buffer of about their size, or grows the largest smaller
one for a buffer larger than any (its pages move, only the rest faults in); smaller ones still go to malloc, which
reuses its heap well for them. The engine empties the cache whenever it runs out of work, so an idle
server does not hold its busiest step's memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from qwenbatch.layers.cpu_kernels import kernels

logger = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 1 << 30


@dataclass(frozen=True)
class StepBufferStats:
    """Bytes of the allocator's large buffers: in tensors now, and freed but kept for reuse."""

    in_use: int
    cached: int


def cache_step_buffers(limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
    """Makes the caching allocator PyTorch's CPU allocator for this process, keeping up to ``limit_bytes`` of freed
    buffers (a later call only changes the limit). Tensors allocated before keep their own deleter."""
    kernels().install_step_buffer_allocator(limit_bytes)
    logger.info("CPU step buffers of >= 32 MiB: cached for reuse, up to %d MiB", limit_bytes >> 20)


def return_cached_buffers() -> None:
    """Unmaps every cached buffer: the next step maps (and faults in) what it needs again."""
    kernels().empty_step_buffer_cache()


def step_buffer_stats() -> StepBufferStats:
    """What the allocator holds now (zero both ways where it was never installed)."""
    in_use, cached = kernels().step_buffer_stats()
    return StepBufferStats(in_use, cached)
