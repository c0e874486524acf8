"""Prefill attention runs in whichever of our kernel and SDPA's flash kernel was timed faster at load
(layers/prefill_choice.py), in bf16 and float32 engines: the engine records the choice and runs its prefill chunks
in that kernel only."""

from __future__ import annotations

import time

import pytest
import torch

from qwenbatch.layers import attention, prefill_choice
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.prefill_choice import OURS, SDPA, SDPA_UNTIMED, choose_prefill_attention, our_isa

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=DTYPES, ids=["bf16", "float32"])
def dtype(request) -> torch.dtype:
    """An engine dtype whose kernel this CPU has (in a fixture: collecting the tests must not build the kernels)."""
    if not our_isa(request.param):
        pytest.skip(f"our {request.param} prefill kernel was not built for this CPU")
    return request.param


@pytest.fixture
def kernel_calls(monkeypatch, dtype) -> list[int]:
    """Query lengths of each call of our prefill kernel."""
    calls: list[int] = []
    real = kernels().prefill_attention
    monkeypatch.setattr(kernels(), "prefill_attention", lambda q, *a, **kw: calls.append(len(q)) or real(q, *a, **kw))
    return calls


def slow_down(monkeypatch, kernel: str, seconds: float = 0.02) -> None:
    """Make ``kernel`` (OURS or SDPA) take ``seconds`` longer a call, as a slower kernel on another CPU would."""
    if kernel == OURS:
        real = kernels().prefill_attention
        monkeypatch.setattr(kernels(), "prefill_attention", lambda *a, **kw: time.sleep(seconds) or real(*a, **kw))
    else:
        real = attention.sdpa_chunk_attention
        slowed = lambda *a: time.sleep(seconds) or real(*a)  # noqa: E731
        monkeypatch.setattr(prefill_choice, "sdpa_chunk_attention", slowed)
        monkeypatch.setattr(attention, "sdpa_chunk_attention", slowed)


@pytest.mark.parametrize("slower", [OURS, SDPA])
def test_the_kernel_timed_faster_is_chosen(monkeypatch, dtype, slower):
    slow_down(monkeypatch, slower)
    choice = choose_prefill_attention(heads=14, kv_heads=2, head_dim=64, dtype=dtype, tokens=64)
    faster = SDPA if slower == OURS else OURS
    assert choice.kernel == faster
    slow_ms, fast_ms = (choice.ours_ms, choice.sdpa_ms) if slower == OURS else (choice.sdpa_ms, choice.ours_ms)
    assert slow_ms >= 20 > fast_ms  # best of the runs, each in milliseconds
    ours = f"{OURS} ({our_isa(dtype)})"  # the unit our kernel takes its products with
    assert choice.ours_isa == our_isa(dtype)
    described = choice.describe()
    assert described.startswith(f"{ours if faster == OURS else SDPA} (timed on 64 tokens: {ours} ")


def test_where_our_kernel_cannot_run_sdpa_runs_untimed():
    for dtype, head_dim in ((torch.float16, 64), (torch.bfloat16, 48), (torch.float32, 40)):
        assert choose_prefill_attention(14, 2, head_dim, dtype) == SDPA_UNTIMED


@pytest.mark.parametrize("slower", [OURS, SDPA])
def test_an_engine_prefills_in_the_kernel_it_chose(tiny_qwen3, monkeypatch, kernel_calls, dtype, slower):
    """tiny_qwen3 has head_dim 32, which our kernels take: the engine times both at load and runs its prompts'
    chunks (after a cached prefix too) in the faster one only; the prompts' next-token log-probabilities are the
    PyTorch path's within the dtype's rounding either way."""
    from qwenbatch import LLM, SamplingParams

    name = str(dtype).removeprefix("torch.")
    common = dict(model=str(tiny_qwen3), dtype=name, kv_cache_memory=8 * 2**20, max_num_batched_tokens=32)
    plain = LLM(**common, cpu_kernels="off")
    slow_down(monkeypatch, slower)
    fused = LLM(**common, cpu_kernels="on")
    chosen = SDPA if slower == OURS else OURS
    named = SDPA if chosen == SDPA else f"{OURS} ({our_isa(dtype)})"
    assert fused.engine.runner.prefill_attention.startswith(f"{named} (timed on ")
    assert plain.engine.runner.prefill_attention == SDPA
    kernel_calls.clear()  # the timing's calls
    prompts = [[5, 9, 14, 3, 7], list(range(20, 90)), [8, 30, 6, 17, 2, 11, 4]]
    # Log-probabilities, not greedy tokens: the random model's distributions are nearly flat, and bf16 rounding
    # turns its near-ties (0.03 apart) into ties either way. In float32 the two agree to float32 rounding.
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    want = [o.outputs[0].logprobs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].logprobs[0] for o in fused.generate(prompts, params, use_tqdm=False)]
    for top_want, top_got in zip(want, got, strict=True):
        shared = top_want.keys() & top_got.keys()
        assert len(shared) >= 3
        assert max(abs(top_want[t] - top_got[t]) for t in shared) < (0.05 if dtype == torch.bfloat16 else 1e-4)
    # Every prompt token's attention, in each of the 3 layers, in our kernel or none of it.
    assert sum(kernel_calls) == (3 * (5 + 70 + 7) if chosen == OURS else 0)
    if chosen == OURS:
        assert len(kernel_calls) > 3 * len(prompts)  # the 70-token prompt ran in chunks after its cached start
