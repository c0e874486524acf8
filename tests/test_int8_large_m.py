"""A bf16 engine's int8 linears run as dense bf16 matmuls on their dequantized weights from the row count at which
that was timed faster at load (layers/int8_large_m.py), and give the int8 kernel's results within bf16 rounding."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from conftest import kernel_targets
from qwenbatch import LLM, SamplingParams
from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.layers import int8_large_m
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.int8_large_m import NEVER_DENSE, choose_int8_large_m, first_mlp_linears
from qwenbatch.layers.int8_linear import (
    Int8Linear,
    dequantize,
    interleave_gate_up,
    pack,
    pack_q5,
    quantize_weight,
    quantize_weight_q5,
)


def cpu_has(flag: str) -> bool:
    return flag in cpu_flags()


# avx512: AVX-512 without BF16, whose conversion to bf16 rounds in integer code of its own.
@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable", "avx512"))
@pytest.mark.parametrize("bits", [8, 5])
@pytest.mark.parametrize("gate_up_halves", [False, True])
def test_dequantized_weight_is_the_packed_one_rounded_to_bf16(target, bits, gate_up_halves):
    if target == "avx512" and not cpu_has("avx512bw"):
        pytest.skip("the avx512 build needs an AVX-512 CPU")
    torch.manual_seed(bits)
    n, k = 96, 128
    weight = torch.randn(n, k) * torch.rand(n, 1)
    values, scales = (quantize_weight_q5 if bits == 5 else quantize_weight)(weight)
    order = interleave_gate_up(n) if gate_up_halves else torch.arange(n)  # as a fused gate_up is packed
    packed, packed_scales = (pack_q5 if bits == 5 else pack)(values[order], scales[order])
    weight_t = kernels(target).int8_dequantize(packed, packed_scales, n, k, bits, gate_up_halves)
    assert weight_t.dtype == torch.bfloat16 and weight_t.shape == (k, n)
    assert torch.equal(weight_t, dequantize(values, scales).bfloat16().t())


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(64, 128, bias=False)
        self.down_proj = nn.Linear(64, 64, bias=False)


@pytest.mark.parametrize(
    ("layer", "fused"),
    [
        (nn.Linear(64, 50), False),
        (nn.Linear(64, 160, bias=False), True),
        (nn.Linear(64, 160), True),
        (nn.Linear(96, 48, bias=False), False),
    ],
)
def test_dense_forward_gives_the_kernels_result(layer, fused):
    # 50 output features with a bias: padded to 64 and sliced back; 160: a gated MLP's gate_up with SiLU(gate) * up,
    # with and without a bias (large, so that one added in the wrong order could not pass for rounding).
    torch.manual_seed(1)
    if layer.bias is not None:
        layer.bias.data = torch.randn(layer.out_features) * 2
    int8 = Int8Linear(layer, silu_and_mul=fused)
    x = (torch.randn(2, 17, layer.in_features) * 2).bfloat16()
    want = int8(x)
    int8.dense_from_rows = 34
    got = int8(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # Both round to bf16; the kernel also quantizes x to int8 per 32 values.
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.03 * float(want.abs().max()))
    assert int8(x.float()).dtype == torch.float32  # float32 x never runs dense


def slow_down(monkeypatch, path: str, slowed_at: Callable[[int], bool], seconds: float = 0.01) -> None:
    """Make Int8Linear's ``path`` ("kernel_forward" or "dense_forward") ``seconds`` slower a call at the row counts
    ``slowed_at`` names, as a slower kernel on another CPU would be."""
    real = getattr(Int8Linear, path)

    def slowed(self, rows):
        if slowed_at(len(rows)):
            time.sleep(seconds)
        return real(self, rows)

    monkeypatch.setattr(Int8Linear, path, slowed)


def mlp_linears() -> list[Int8Linear]:
    mlp = GatedMLP()
    return [Int8Linear(mlp.gate_up_proj, silu_and_mul=True), Int8Linear(mlp.down_proj)]


def test_dense_is_chosen_from_the_fewest_rows_at_which_it_is_timed_faster(monkeypatch):
    slow_down(monkeypatch, "kernel_forward", lambda rows: rows >= 64)
    slow_down(monkeypatch, "dense_forward", lambda rows: rows < 64)
    choice = choose_int8_large_m(mlp_linears(), rows=(16, 64, 256))
    assert choice.dense_from_rows == 64
    assert [t.rows for t in choice.timings] == [16, 64, 256]  # all timed: dense won down to 64
    assert all(t.int8_ms >= 20 > t.dense_ms for t in choice.timings[1:])  # two layers, 10 ms each
    assert choice.timings[0].dense_ms >= 20 > choice.timings[0].int8_ms
    assert choice.describe().startswith("dequantized to bf16 for a dense matmul from 64 rows (timed int8 / dense: ")


def test_the_int8_kernel_stays_where_dense_is_slower_at_the_most_rows(monkeypatch):
    slow_down(monkeypatch, "dense_forward", lambda rows: True)
    choice = choose_int8_large_m(mlp_linears(), rows=(16, 64, 256))
    assert choice.dense_from_rows is None
    assert [t.rows for t in choice.timings] == [256]  # fewer rows are not timed
    assert choice.describe().startswith("int8 kernel at every row count (timed int8 / dense: 256 rows ")
    assert choose_int8_large_m([]) == NEVER_DENSE


@pytest.mark.parametrize(("dense_ms", "chosen"), [(9.5, None), (8.5, 256)])
def test_dense_must_win_by_a_margin(monkeypatch, dense_ms, chosen):
    # Within 10% of the int8 kernel, noise could have made the choice: the int8 kernel stays.
    timed = lambda linears, xs, repeats: int8_large_m.RowsTiming(len(xs[0]), 10.0, dense_ms)  # noqa: E731
    monkeypatch.setattr(int8_large_m, "_time_both", timed)
    assert choose_int8_large_m(mlp_linears(), rows=(256, 1024)).dense_from_rows == chosen


@pytest.fixture
def dense_calls(monkeypatch) -> list[int]:
    """Row counts of each dense_forward call."""
    calls: list[int] = []
    real = Int8Linear.dense_forward
    monkeypatch.setattr(Int8Linear, "dense_forward", lambda self, rows: calls.append(len(rows)) or real(self, rows))
    return calls


def test_an_int8_bf16_engine_runs_dense_from_the_chosen_rows(tiny_qwen3, monkeypatch, dense_calls):
    """With dense timed faster from 16 rows, a prompt of 40 tokens runs its linears dense and decode steps of one
    row stay in the int8 kernel; its next-token log-probabilities are the all-int8 engine's within bf16 rounding."""
    common = dict(model=str(tiny_qwen3), dtype="bfloat16", kv_cache_memory=8 * 2**20, quantization="int8")
    timed = LLM(**common).engine.runner.linear_kernels  # what this CPU chose, on the tiny model's shapes
    assert " (timed int8 / dense: " in timed and "1024 rows " in timed  # 256 too where dense won at 1024
    monkeypatch.setattr(int8_large_m, "choose_int8_large_m", lambda linears: NEVER_DENSE)
    int8_only = LLM(**common)
    assert int8_only.engine.runner.linear_kernels.endswith(", int8 kernel at every row count")
    monkeypatch.setattr(int8_large_m, "choose_int8_large_m", lambda linears: int8_large_m.Int8LargeMChoice(16))
    dense = LLM(**common)
    assert dense.engine.runner.linear_kernels.endswith(", dequantized to bf16 for a dense matmul from 16 rows")
    model = dense.engine.runner.model
    assert {m.dense_from_rows for m in model.modules() if isinstance(m, Int8Linear) and m is not model.lm_head} == {16}
    assert model.lm_head.dense_from_rows is None  # never timed, and a vocabulary-sized matrix to dequantize
    assert first_mlp_linears(dense.engine.runner.model)
    prompt = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    want = int8_only.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    dense_calls.clear()
    got = dense.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert dense_calls and set(dense_calls) == {40}  # the prompt's rows only, never a decode step
    assert len(got.token_ids) == 4
    top_want, top_got = want.logprobs[0], got.logprobs[0]
    shared = top_want.keys() & top_got.keys()
    assert len(shared) >= 3
    assert max(abs(top_want[t] - top_got[t]) for t in shared) < 0.05


def test_decode_steps_of_as_many_rows_run_dense_too(tiny_qwen3, monkeypatch, dense_calls):
    """Decode-only steps go to the fused decode layer's int8 kernel below the chosen row count, and through the
    layers' own forward, dense, from it (a large batch decoding on the AMX kind)."""
    monkeypatch.setattr(int8_large_m, "choose_int8_large_m", lambda linears: int8_large_m.Int8LargeMChoice(16))
    llm = LLM(model=str(tiny_qwen3), dtype="bfloat16", kv_cache_memory=8 * 2**20, quantization="int8")
    fused_calls = []
    for name in ("decode_layer", "decode_layers"):  # a layer at a time, or the stack of them in one call
        real = getattr(kernels(), name)
        monkeypatch.setattr(kernels(), name, lambda x, *a, real=real: fused_calls.append(len(x)) or real(x, *a))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for batch in (20, 4):
        dense_calls.clear()
        fused_calls.clear()
        outs = llm.generate([[5 + i, 9, 14] for i in range(batch)], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3] * batch
        if batch == 20:  # the prompts' 60 rows, then two decode steps of 20, all dense (the LM head never)
            assert set(dense_calls) == {60, 20} and not fused_calls
        else:  # 12 prompt rows and steps of 4: the int8 kernel, decode steps fused
            assert not dense_calls and set(fused_calls) == {4}
