"""Memory that a decode step reads all over, in one mapping backed by 2 MiB pages: the weights it streams, and
the host KV pool.

A batch-1 decode step reads every weight once: 0.43 GB for the default model under int8, ~106,000 pages of
4 KiB a step. Each page is a TLB miss, and the hardware prefetchers stop at every page boundary. Linux backs
anonymous memory with transparent huge pages where the process asks (``madvise``, the usual setting and the one
these machines have; PyTorch's allocator does not ask). Copying the packed weights into one such mapping, in the
order the layers run, made batch-1 decode ~9% faster (BENCHMARKS.md, issue 15). A decode step's attention reads
each sequence's KV blocks scattered through gigabytes of pool, a few KB from each 4 KiB page: on 2 MiB pages
decode attention ran ~10% faster from memory.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as PyTorch's allocator places them


def padded_bytes(nbytes: int) -> int:
    """What ``nbytes`` take in an arena: each tensor starts on a cache line."""
    return -(-nbytes // _ALIGN) * _ALIGN


class HugePageArena:
    """One anonymous mapping, asked to be backed by transparent huge pages, that tensors are copied into
    (``place``) or made in (``empty``) one after another; each keeps the mapping alive. ``for_tensors`` sizes it
    for a set of tensors, ``padded_bytes`` gives what one takes."""

    def __init__(self, nbytes: int) -> None:
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        # One huge page over: the copies start on a huge-page boundary whatever address the mapping gets.
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = advice is not None
        if advice is not None:
            try:
                region.madvise(advice)
            except OSError as e:  # a kernel built without transparent huge pages: plain pages, still one mapping
                logger.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
                self.huge_pages = False
        self._bytes = torch.frombuffer(region, dtype=torch.uint8)
        self._next = -self._bytes.data_ptr() % HUGE_PAGE_BYTES
        self._end = self._next + nbytes

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor]) -> HugePageArena:
        return cls(sum(padded_bytes(t.numel() * t.element_size()) for t in tensors))

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor at the arena's next free cache line. Its pages are untouched until
        written, so they take no memory before, and come as huge pages then."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._next + nbytes > self._end:
            raise ValueError(f"the arena has {self._end - self._next} bytes left, not {nbytes}")
        tensor = self._bytes[self._next : self._next + nbytes].view(dtype).view(tuple(shape))
        self._next += padded_bytes(nbytes)
        return tensor

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU ``tensor`` at the arena's next free cache line."""
        copy = self.empty(tensor.shape, tensor.dtype)
        copy.copy_(tensor)
        return copy
