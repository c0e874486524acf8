"""The CPU attention path stays on SDPA's fused (flash) kernel for prefill, chunked prefill and decode, wherever our
own kernels leave attention to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.attention import (
    SPLIT_CHUNK_MIN_QUERIES,
    StepLayout,
    TorchAttentionMetadata,
    _prefix_then_causal,
)


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


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
def test_an_engine_step_with_every_kind_of_attention_runs_no_math_path(tiny_qwen2, cpu_kernels):
    """Without our kernels every attention call is SDPA's flash kernel; with them decode and (where timed faster)
    prefill run in ours, and whatever is left to SDPA is still its flash kernel, never its math path."""
    llm = LLM(
        model=str(tiny_qwen2),
        dtype="float32",
        kv_cache_memory=8 * 2**20,
        max_num_batched_tokens=32,
        cpu_kernels=cpu_kernels,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.step()  # "short" decodes from now on
    engine.add_request("long", list(range(10, 90)), params)  # 80 tokens: chunks of <= 31 beside the decode
    kernels: set[str] = set()
    while engine.has_unfinished():
        kernels |= _sdpa_kernels(engine.step)
    if cpu_kernels == "off" or engine.runner.prefill_attention.startswith("sdpa"):
        assert any("flash" in name for name in kernels), kernels
    assert not any("math" in name for name in kernels), kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_chunk_after_a_prefix_gives_the_bottom_right_causal_attention(monkeypatch, dtype):
    """A chunk of >= SPLIT_CHUNK_MIN_QUERIES queries runs as two flash calls merged by their log-sum-exps; it
    must give what one call with the bottom-right causal mask gives, and stay on the flash kernel."""
    split_calls = []

    def counted(*args, **kwargs):
        split_calls.append(args[3])
        return _prefix_then_causal(*args, **kwargs)

    monkeypatch.setattr("qwenbatch.layers.attention._prefix_then_causal", counted)
    heads, kv_heads, head_dim, bs, cached, chunk = 14, 2, 64, 16, 300, SPLIT_CHUNK_MIN_QUERIES + 76
    torch.manual_seed(1)
    blocks = -(-(cached + chunk) // bs)
    cache = torch.randn(2, blocks + 4, bs, kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(blocks + 4)[:blocks].tolist()
    layout = StepLayout(bs)
    layout.add_prefill([1] * chunk, table, cached)
    meta = TorchAttentionMetadata.build(layout, torch.device("cpu"))
    q = torch.randn(chunk, heads, head_dim, dtype=dtype)
    k = torch.randn(chunk, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(chunk, kv_heads, head_dim, dtype=dtype)
    kernels = _sdpa_kernels(lambda: meta.attend(q, k, v, cache, head_dim**-0.5))
    got = meta.attend(q, k, v, cache, head_dim**-0.5).view(chunk, heads, head_dim)
    assert any("flash" in name for name in kernels) and not any("math" in name for name in kernels), kernels
    assert split_calls == [cached, cached]  # the profiled call and this one: the split ran, after the prefix

    slots = [table[p // bs] * bs + p % bs for p in range(cached + chunk)]
    context_k = cache[0].view(-1, kv_heads, head_dim)[slots]  # the chunk's own K/V were stored by attend
    context_v = cache[1].view(-1, kv_heads, head_dim)[slots]
    mask = torch.ones(chunk, cached + chunk, dtype=torch.bool).tril(cached)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        context_k.transpose(0, 1)[None],
        context_v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=head_dim**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the two halves are rounded before the merge
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
