"""--compile: torch.compile (inductor, frozen weights) of the model between attention calls."""

from __future__ import annotations

import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.config import EngineConfig


def test_a_compiled_engine_computes_what_the_eager_one_does(tiny_qwen2):
    common = dict(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=8 * 2**20, max_num_batched_tokens=24)
    eager, compiled = LLM(**common), LLM(**common, compile=True)
    assert compiled.engine.runner.linear_kernels.startswith("inductor")
    sequence = [5, 9, 14, 3, 7, 21, 11, 4, 8, 30, 6, 17]
    want = eager.engine.runner.sequence_logits(sequence)
    got = compiled.engine.runner.sequence_logits(sequence)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Prompts of several lengths, chunked by the 24-token budget, then decodes of 3, 2 and 1 rows: steps of
    # many token counts, which a graph symbolic in the count must serve without compiling for each.
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (eager, compiled)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3  # one token; many; nothing more


def test_compile_is_refused_where_it_cannot_run(fake_cuda):
    assert not EngineConfig(dtype="bfloat16", compile=True).uses_cpu_kernels  # it replaces them
    with pytest.raises(ValueError, match="compile replaces the CPU kernels"):
        EngineConfig(compile=True, quantization="int8")
    with pytest.raises(ValueError, match="compile replaces the CPU kernels"):
        EngineConfig(compile=True, cpu_kernels="on")
    fake_cuda()
    with pytest.raises(ValueError, match="compile runs on the CPU only"):
        EngineConfig(compile=True, device="cuda")


def test_the_flag_and_its_environment_variable_reach_the_engine(monkeypatch):
    from qwenbatch.cli import build_parser
    from qwenbatch.commands.engine_args import engine_config_from_args

    def config(*argv: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(["generate", "hi", *argv]))

    assert not config().compile
    assert config("--compile").compile
    monkeypatch.setenv("QWENBATCH_COMPILE", "true")
    assert config().compile
    assert not config("--no-compile").compile
