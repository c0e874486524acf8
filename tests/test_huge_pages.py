"""Packed weights copied into one mapping advised for transparent huge pages (layers/huge_pages.py)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys

import pytest
import torch
from torch import nn

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.huge_pages import HUGE_PAGE_BYTES, HugePageArena
from qwenbatch.layers.int8_linear import Int8Linear

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address`` ("hg": advised for huge pages)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                mapping = start <= address < end
            elif head == "VmFlags:" and mapping:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_equal_their_tensors_in_order_on_cache_lines():
    torch.manual_seed(0)
    tensors = [
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
        torch.randn(17, 3).half(),
        torch.randn(8, 6).t(),  # not contiguous: copied contiguous
        torch.empty(0, dtype=torch.float32),
        torch.randn(5, dtype=torch.float64),
    ]
    arena = HugePageArena.for_tensors(tensors)
    copies = [arena.place(t) for t in tensors]
    for t, c in zip(tensors, copies, strict=True):
        assert torch.equal(c, t) and c.dtype == t.dtype and c.is_contiguous()
    addresses = [c.data_ptr() for c in copies if c.numel()]
    assert addresses == sorted(addresses)
    assert all(a % 64 == 0 for a in addresses)
    assert addresses[0] % HUGE_PAGE_BYTES == 0
    with pytest.raises(ValueError, match="bytes left"):
        arena.place(torch.zeros(1))


def test_copies_outlive_the_arena_object():
    t = torch.arange(4096, dtype=torch.int32)
    arena = HugePageArena.for_tensors([t])
    copy = arena.place(t)
    del arena
    gc.collect()
    assert torch.equal(copy * 2, t * 2)


@linux_only
def test_the_mapping_is_advised_for_huge_pages():
    arena = HugePageArena(3 * HUGE_PAGE_BYTES)
    assert arena.huge_pages
    copy = arena.place(torch.ones(HUGE_PAGE_BYTES // 4))
    assert "hg" in vm_flags(copy.data_ptr())
    plain = mmap.mmap(-1, 3 * HUGE_PAGE_BYTES)  # the same kind of mapping, not advised: the flag is the arena's doing
    anchor = ctypes.c_char.from_buffer(plain)
    address = ctypes.addressof(anchor)
    del anchor  # an exported buffer would keep the mapping from closing
    assert "hg" not in vm_flags(address)
    plain.close()


@linux_only
def test_an_int8_engine_streams_its_packed_weights_from_one_huge_page_mapping(tiny_qwen2):
    llm = LLM(model=str(tiny_qwen2), dtype="float32", quantization="int8", kv_cache_memory=8 * 2**20)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
    addresses = [a for m in layers for a in (m.packed_weight.data_ptr(), m.packed_scales.data_ptr())]
    assert addresses == sorted(addresses)  # the order the layers run
    assert all("hg" in vm_flags(a) for a in addresses)
    assert not any(isinstance(m, nn.Linear) for m in llm.engine.runner.model.modules())
    out = llm.generate([[5, 9, 14, 3]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
