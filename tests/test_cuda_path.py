"""The CUDA path, tested on CPU: device and dtype defaults, GPU memory sizing, the decode-graph ladder and
its buffers, the Triton backend inside the engine (under TRITON_INTERPRET=1), and the GPU script's smoke run."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.cli import main
from qwenbatch.config import EngineConfig
from qwenbatch.engine.cuda_graphs import DecodeBuffers, graph_batch_sizes, padded_batch_size
from qwenbatch.engine.memory import gpu_kv_cache_budget
from qwenbatch.engine.model_runner import pack_step
from qwenbatch.engine.scheduler import ScheduledSequence, SchedulerOutput
from qwenbatch.engine.sequence import Sequence
from qwenbatch.layers.attention import StepLayout
from qwenbatch.layers.rotary import RotaryEmbedding, same_device
from qwenbatch.layers.triton_backend import TritonAttentionMetadata

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# -- device and dtype ------------------------------------------------------------------------------


def test_auto_device_is_the_cpu_without_cuda():
    config = EngineConfig()
    assert config.resolved_device == torch.device("cpu")
    assert config.resolved_attention_backend == "torch"


def test_cuda_without_a_device_is_an_error_naming_it():
    with pytest.raises(ValueError, match="device cuda: no CUDA device"):
        EngineConfig(device="cuda")


def test_cli_device_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["generate", "hi", "--device", "cuda"]) != 0
    err = capsys.readouterr().err.strip()
    assert "device cuda" in err and len(err.splitlines()) == 1


def test_batch_limits_default_by_device_as_vllm_offline(monkeypatch, fake_cuda):
    from types import SimpleNamespace

    cpu = EngineConfig(device="cpu")
    assert (cpu.resolved_max_num_seqs, cpu.resolved_max_num_batched_tokens) == (256, 2048)
    made_here = EngineConfig()  # device auto, limits unset: a Ray driver's config, say
    assert (made_here.max_num_seqs, made_here.max_num_batched_tokens) == (None, None)
    fake_cuda()
    for name, gib, expected in [
        ("NVIDIA H200", 140, (1024, 16384)),
        ("NVIDIA A100-SXM4-80GB", 80, (256, 8192)),
        ("NVIDIA L4", 22, (256, 8192)),
    ]:
        props = SimpleNamespace(name=name, total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        config = EngineConfig(device="cuda")
        assert (config.resolved_max_num_seqs, config.resolved_max_num_batched_tokens) == expected, name
        # Unset limits resolve where the engine runs: the driver's config on a replica with this GPU.
        assert (made_here.resolved_max_num_seqs, made_here.resolved_max_num_batched_tokens) == expected, name
        assert EngineConfig(device="cuda", max_num_seqs=8).resolved_max_num_seqs == 8
        assert EngineConfig(device="cuda", max_num_batched_tokens=512).resolved_max_num_batched_tokens == 512


def test_cuda_defaults_to_bfloat16_and_triton(fake_cuda):
    fake_cuda()
    for device in ("auto", "cuda"):
        config = EngineConfig(device=device)
        assert config.resolved_device.type == "cuda"
        assert config.torch_dtype == torch.bfloat16
        assert config.resolved_attention_backend == "triton"
    assert EngineConfig(device="cuda", dtype="float32").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(device="cuda", kv_cache_memory=0.5)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "0.9"])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_unknown_device_and_backend_are_rejected():
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


# -- GPU memory sizing -----------------------------------------------------------------------------


def test_gpu_kv_budget_is_the_fraction_less_what_is_held_and_the_step_peak():
    gib = 2**30
    # 80 GiB card, 0.9 -> 72 GiB allowed; 2 GiB in use (weights, context); a step peaks 3 GiB higher.
    assert gpu_kv_cache_budget(80 * gib, 78 * gib, 3 * gib, 0.9) == 67 * gib
    # Another process holding 20 GiB counts against the fraction too.
    assert gpu_kv_cache_budget(80 * gib, 58 * gib, 3 * gib, 0.9) == 47 * gib


def test_gpu_kv_budget_that_leaves_nothing_is_an_error_with_the_numbers():
    gib = 2**30
    with pytest.raises(ValueError, match=r"leaves no room.*1\.50 GiB in use.*9\.00 GiB more"):
        gpu_kv_cache_budget(16 * gib, int(14.5 * gib), 9 * gib, 0.5)


# -- the decode-graph ladder and its buffers -------------------------------------------------------


def test_graph_ladder_is_powers_of_two_then_steps_of_8_up_to_256_then_of_16_up_to_512():
    full = graph_batch_sizes(512)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-1] == 512
    assert all(b - a == 8 for a, b in itertools.pairwise(full[4 : full.index(256) + 1]))
    assert all(b - a == 16 for a, b in itertools.pairwise(full[full.index(256) :]))
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(100)[-2:] == [96, 104]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(300)[-2:] == [288, 304]
    assert graph_batch_sizes(1024) == full


def test_a_step_pads_up_to_the_next_rung_or_runs_eagerly_past_the_top():
    sizes = graph_batch_sizes(256)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 9, 17, 24, 25, 256)] == [1, 2, 4, 8, 16, 24, 24, 32, 256]
    assert padded_batch_size(257, sizes) is None
    assert padded_batch_size(500, graph_batch_sizes(1024)) == 512
    assert padded_batch_size(513, graph_batch_sizes(1024)) is None


def _decode_layout(block_size: int = 4) -> StepLayout:
    layout = StepLayout(block_size)
    layout.add_decode(11, [7, 2], 6)  # position 5: block 2, offset 1 -> slot 9
    layout.add_decode(12, [3], 1)  # position 0: slot 12
    layout.add_decode(13, [5, 6, 1], 9)  # position 8: block 1, offset 0 -> slot 4
    return layout


def test_buffers_take_the_step_and_pad_rows_that_store_and_read_nothing():
    buffers = DecodeBuffers(max_batch=8, max_blocks=5, device=torch.device("cpu"))
    buffers.block_tables.fill_(99)  # stale ids from an earlier step
    buffers.fill(_decode_layout(), 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 8, 0]
    assert buffers.slot_mapping[:4].tolist() == [9, 12, 4, -1]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 9, 0]
    assert buffers.block_tables[:4, :3].tolist() == [[7, 2, 0], [3, 0, 0], [5, 6, 1], [0, 0, 0]]
    assert buffers.block_tables[:4, 3:].eq(99).all()  # past the longest table: never read, not copied
    meta = buffers.metadata(4)
    assert meta.num_decodes == 4 and meta.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()


def test_buffers_refuse_prefills_and_oversized_steps():
    buffers = DecodeBuffers(max_batch=2, max_blocks=4, device=torch.device("cpu"))
    with pytest.raises(ValueError):
        buffers.fill(_decode_layout(), 4)
    layout = _decode_layout()
    layout.add_prefill([1, 2, 3], [8], 0)
    with pytest.raises(ValueError):
        DecodeBuffers(8, 4, torch.device("cpu")).fill(layout, 8)


def _seq(seq_id: int, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, tokens, len(tokens), GREEDY, 4)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def test_rotary_table_outlives_steps_whatever_the_device_is_called(monkeypatch):
    """Decode graphs capture the rotary table: a step that asks for covered positions must keep it. On the
    H200 the engine's ``cuda`` never equalled the table's ``cuda:0``, so it doubled every step (OOM) and
    the graphs read the freed one (illegal memory access)."""
    rotary = RotaryEmbedding(32, 10_000.0)
    rotary.reserve(100, torch.device("cpu"))
    table = rotary._cos
    rotary.reserve(100, torch.device("cpu", 0))
    assert rotary._cos is table
    rotary.reserve(5000, torch.device("cpu"))
    assert rotary._cos.shape[0] >= 5000
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not same_device(torch.device("cuda", 1), torch.device("cuda"))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))


def test_steps_pack_decodes_first_and_sample_rows_follow_scheduling_order():
    prefill = _seq(0, list(range(10)), 4, [3, 4, 5])  # a 6-token chunk at positions 4..9
    decode = _seq(1, list(range(7)), 6, [1, 2])  # position 6
    sched = SchedulerOutput([ScheduledSequence(prefill, 6, True), ScheduledSequence(decode, 1, True)])
    step = pack_step(sched, block_size=4)
    layout, rows = step.layout, step.sample_rows
    assert layout.input_ids == [6, 4, 5, 6, 7, 8, 9]
    assert layout.positions == [6, 4, 5, 6, 7, 8, 9]
    assert layout.slot_mapping == [10, 16, 17, 18, 19, 20, 21]
    assert layout.decode_lens == [7] and layout.prefills[0].query_start == 1
    assert rows == [6, 0]  # the prefill samples its last row, the decode its only one


# -- the Triton backend inside the engine (interpreter on CPU) -------------------------------------


def _prompts() -> list[list[int]]:
    return [[5, 17, 42, 99, 3], [300, 12], list(range(10, 130, 3)), [7] * 40, list(range(10, 130, 3))[:33]]


@pytest.fixture(scope="module")
def torch_tokens(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=8 * 2**20, attention_backend="torch")
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def test_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_qwen3, torch_tokens):
    # A 24-token budget chunks the 40-token prompts and mixes decodes with prefill chunks; the last
    # prompt shares 32 tokens (two blocks) with the third, so it reads cached blocks too.
    llm = LLM(
        model=str(tiny_qwen3),
        dtype="float32",
        kv_cache_memory=8 * 2**20,
        attention_backend="triton",
        max_num_batched_tokens=24,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert got == torch_tokens
    assert llm.engine.block_manager.prefix_cache_hits > 0


def test_graph_buffers_padding_rows_leave_the_real_rows_unchanged(tiny_qwen3):
    """The forward a graph captures, run eagerly on the buffers: padded rows change neither the real
    rows' hidden states nor the cache."""
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=4 * 2**20, attention_backend="triton")
    runner = llm.engine.runner
    torch.manual_seed(0)
    for cache in runner.kv_caches:  # contexts already cached
        cache.normal_()
    layout = StepLayout(runner.block_size)
    layout.add_decode(77, [0], 8)
    layout.add_decode(78, [1], 4)
    with torch.inference_mode():
        runner.model.reserve_positions(16, runner.device)
        before = [c.clone() for c in runner.kv_caches]
        meta = TritonAttentionMetadata.build(layout, runner.device)
        ids, pos = torch.tensor(layout.input_ids), torch.tensor(layout.positions)
        eager = runner.model(ids, pos, [c.clone() for c in before], meta)
        buffers = DecodeBuffers(8, 4, runner.device)
        buffers.fill(layout, 8)
        caches = [c.clone() for c in before]
        padded = runner.model(buffers.input_ids[:8], buffers.positions[:8], caches, buffers.metadata(8))
    torch.testing.assert_close(padded[:2], eager, rtol=0, atol=1e-6)
    assert padded[2:].isfinite().all()
    for old, new in zip(before, caches, strict=True):  # only the two real slots were written
        changed = (old != new).flatten(3).any(-1).any(0)  # [blocks, block_size]
        assert changed.nonzero().tolist() == [[0, 7], [1, 3]]


# -- the prepared GPU script ------------------------------------------------------------------------


def test_gpu_script_smoke_runs_end_to_end_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--smoke", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert report["parity"] == {"eager": True}
    assert report["moe_parity"]["float32_agreement"] == 1.0 and report["moe_parity"]["ok"]
    for key in ("a", "b", "c"):
        assert report[key]["output_tps"] > 0 and report[key]["requests"] > 0
    assert report["a"]["requests"] == 4 and report["b"]["requests"] == 6
    assert report["sampler"]["topk_ms"] > 0 and report["sampler"]["sort_ms"] > 0
    assert report["sampler"]["top_p_probe_ms"] > 0 and report["sampler"]["top_p_sort_ms"] > 0
    assert "req/s" in proc.stdout and "(b) / (c)" in proc.stdout


def test_gpu_memory_report_counts_the_unfilled_kv_pool_out_of_what_a_run_needed():
    from types import SimpleNamespace

    from qwenbatch.bench.machine import PeakGPUMemory, gpu_memory_report

    mib = 2**20
    gpu = PeakGPUMemory(torch.device("cuda"))
    gpu.peak_allocated, gpu.peak_reserved = 1000 * mib, 1200 * mib
    engine = SimpleNamespace(runner=SimpleNamespace(kv_cache_bytes=600 * mib))
    report = gpu_memory_report(gpu, engine, peak_kv_usage=0.25)
    assert report["kv_pool_mib"] == 600 and report["kv_pool_share"] == 0.5
    assert report["gpu_memory_needed_mib"] == 1000 - 600 * 0.75  # the pool's unused 75% is not needed
