"""The fused decode layer (layers/fused_decode.py, csrc/decode_layer.cpp) computes what the layer computes."""

from __future__ import annotations

import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.linear import onednn_available

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79], [50, 28]]


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("checkpoint", ["tiny_qwen2", "tiny_qwen3"])  # biases; per-head q/k norms
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "none"])  # int8 linears; oneDNN's packed ones
def test_fused_decode_steps_give_the_layers_own_tokens_and_logprobs(request, checkpoint, dtype, quantization):
    if quantization == "none" and not onednn_available(getattr(torch, dtype), torch.device("cpu")):
        pytest.skip("oneDNN packs bf16 linears only where the CPU multiplies bf16 natively")
    folder = request.getfixturevalue(checkpoint)
    llm = LLM(model=str(folder), dtype=dtype, quantization=quantization, cpu_kernels="on", kv_cache_memory=8 * 2**20)
    decoder = llm.engine.runner.model.model
    assert all(layer.fused_decode is not None for layer in decoder.layers) and decoder.fused_decode is not None
    calls = 0
    original_call = type(decoder.fused_decode).__call__

    def counting(self, *args):
        nonlocal calls
        calls += 1
        return original_call(self, *args)

    type(decoder.fused_decode).__call__ = counting
    try:
        with_fused = _run(llm)
    finally:
        type(decoder.fused_decode).__call__ = original_call
    assert calls == 11  # every decode step (12 tokens: one from the prefill), all the layers in one call
    for layer in decoder.layers:
        layer.fused_decode = None
    assert _run(llm) == with_fused  # bitwise: the same kernels, the same rounding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_mixing_fused_and_unfused_layers_gives_the_same_tokens(tiny_qwen2, dtype):
    """Layers hand on (output, residual), fused or not: a decode step in which every
    other layer runs its own forward crosses between the two both ways and must give the same bits."""
    if dtype == "bfloat16" and not onednn_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN packs bf16 linears only where the CPU multiplies bf16 natively")
    llm = LLM(model=str(tiny_qwen2), dtype=dtype, cpu_kernels="on", kv_cache_memory=8 * 2**20)
    layers = llm.engine.runner.model.model.layers
    assert len(layers) >= 2 and all(layer.fused_decode is not None for layer in layers)
    all_fused = _run(llm)
    for layer in layers[::2]:
        layer.fused_decode = None
    assert _run(llm) == all_fused


def test_layers_are_not_fused_without_the_cpu_kernels(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", cpu_kernels="off", kv_cache_memory=8 * 2**20)
    decoder = llm.engine.runner.model.model
    assert decoder.fused_decode is None and all(layer.fused_decode is None for layer in decoder.layers)


def test_decode_steps_of_a_row_count_run_in_pieces_keep_the_layers_own_forward(tiny_qwen3):
    """The fused layer calls oneDNN on all its rows at once; where the load-time timing chose pieces for a row
    bucket (oneDNN ran it on one thread, layers/packed_rows.py), steps of that many decode rows take the layer's
    forward, which runs them in pieces."""
    from qwenbatch.layers.attention import KernelAttentionMetadata, StepLayout
    from qwenbatch.layers.linear import PackedLinear

    llm = LLM(model=str(tiny_qwen3), dtype="float32", cpu_kernels="on", kv_cache_memory=8 * 2**20)
    layer = llm.engine.runner.model.model.layers[0]

    def decode_step(rows: int) -> KernelAttentionMetadata:
        layout = StepLayout(16)
        for _ in range(rows):
            layout.add_decode(1, [0], 5)
        return KernelAttentionMetadata.build(layout, torch.device("cpu"))

    assert layer.fused_decode.accepts(decode_step(700)) and layer.fused_decode.accepts(decode_step(900))
    down = layer.mlp.down_proj
    assert isinstance(down, PackedLinear)
    down.pieces_at = frozenset({768})
    assert not layer.fused_decode.accepts(decode_step(700))  # bucket 768
    assert layer.fused_decode.accepts(decode_step(900))  # bucket 1,024
