"""The CPU attention path stays on SDPA's fused (flash) kernel for prefill, chunked prefill and decode."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.attention import StepLayout, TorchAttentionMetadata


def _sdpa_kernels(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk_and_decode_use_the_flash_kernel(dtype):
    heads, kv_heads, head_dim, bs = 14, 2, 64, 16
    torch.manual_seed(0)
    cache = torch.randn(2, 40, bs, kv_heads, head_dim, dtype=dtype)
    layout = StepLayout(bs)
    layout.add_decode(3, [5, 6], 20)
    layout.add_decode(4, [7], 9)
    layout.add_prefill([1] * 50, [0, 1, 2, 3], 0)  # a fresh prompt: causal
    layout.add_prefill([1] * 37, list(range(10, 30)), 263)  # a chunk after 263 cached tokens: masked
    meta = TorchAttentionMetadata.build(layout, torch.device("cpu"))
    n = layout.num_tokens
    q = torch.randn(n, heads, head_dim, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, dtype=dtype)
    kernels = _sdpa_kernels(lambda: meta.attend(q, k, k.clone(), cache, head_dim**-0.5))
    assert any("flash" in name for name in kernels), kernels
    assert not any("math" in name for name in kernels), kernels


def test_an_engine_step_with_every_kind_of_attention_runs_no_math_path(tiny_qwen2):
    llm = LLM(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=8 * 2**20, max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.step()  # "short" decodes from now on
    engine.add_request("long", list(range(10, 90)), params)  # 80 tokens: chunks of <= 31 beside the decode
    kernels: set[str] = set()
    while engine.has_unfinished():
        kernels |= _sdpa_kernels(engine.step)
    assert any("flash" in name for name in kernels)
    assert not any("math" in name for name in kernels), kernels
