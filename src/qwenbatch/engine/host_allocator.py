"""Keeps a CPU engine's large step buffers in the malloc heap, so that each step reuses memory already mapped.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns it with
``munmap`` when freed. A prefill chunk's activations are such buffers (2,048 tokens' gate_up output is 40 MB in
bfloat16), so every chunk of every layer faulted its pages in again and the kernel zeroed them: 12% of the cpu-mixed
workload's prefill went to page faults (perf, BENCHMARKS.md, issue 15). With mmap off for new allocations and a
high trim threshold, freed buffers stay in the heap for the next step. Only allocations made after the engine's
weights and KV pool are placed are affected, so loading's transient peak is still returned to the system; and
whenever the engine runs out of work it gives the heap's free pages back (``return_free_heap``), so a one-off huge
buffer (a long prompt's logits) is not held for the life of a server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

# While the engine works, free memory at the heap's top beyond this much is still given back at once.
TRIM_THRESHOLD_BYTES = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    return ctypes.CDLL(ctypes.util.find_library("c")) if platform.libc_ver()[0] == "glibc" else None


def keep_step_buffers_in_heap() -> bool:
    """Asks glibc's malloc to serve new allocations of any size from its heap and to keep up to
    ``TRIM_THRESHOLD_BYTES`` of freed memory there. True when the C library took both settings; False where it
    is not glibc (musl, macOS: their allocators are left as they are)."""
    libc = _glibc()
    if libc is None:
        return False
    applied = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    logger.info("glibc malloc: large step buffers %s", "kept in the heap" if applied else "left to mmap (refused)")
    return applied


def return_free_heap() -> None:
    """Gives the free pages anywhere in glibc's heaps back to the system (``malloc_trim(0)``): buffers freed
    below live ones stay mapped otherwise, as only the heap's top is trimmed on free. A few ms; the next step
    faults in what it uses again."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
