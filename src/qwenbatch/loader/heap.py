"""Handing the C heap's freed pages back to the system, which loading needs (its temporaries leave holes)."""

from __future__ import annotations

import ctypes


def release_freed_heap() -> bool:
    """Hands the pages of malloc's free chunks back to the system (glibc's ``malloc_trim``); False where the C
    library has no such call. Loading leaves its temporaries' pages in the heap: glibc returns free memory on its
    own only from the heap's top, and the packed weights lie above the holes (the default model's engine held
    ~270 MiB of them, in RSS, until the process ended: BENCHMARKS.md, issue 15)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc's, where it has one
    if trim is None:
        return False
    trim(0)
    return True
