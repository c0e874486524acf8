"""The fused CPU ops (layers/csrc/cpu_ops.cpp, decode_attention.cpp) give what the PyTorch layers they replace give."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import kernel_targets
from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.attention import KernelAttentionMetadata, StepLayout, TorchAttentionMetadata
from qwenbatch.layers.cpu_kernels import KernelRMSNorm, KernelSiluAndMul, kernels, use_cpu_kernels
from qwenbatch.layers.norm import RMSNorm


def _same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """In half precision the kernel rounds where the layer does (float32 inside, then the storage dtype), so
    all but a few elements whose float32 sums differ in the last bit are bitwise equal, and none is far."""
    torch.testing.assert_close(got, want, equal_nan=True)
    assert float((got == want).float().mean()) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 896), (5, 64), (3, 4, 128), (2, 100)])  # 100: not whole 16-lane vectors
def test_rms_norm_matches_the_layer(dtype, shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(shape, dtype=dtype) * 4
    want = norm(x)
    got = kernels().rms_norm(x, norm.weight.data, norm.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5) if dtype == torch.float32 else _same_rounding(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [4864, 100])  # whole 16-lane vectors; a remainder after them
def test_silu_and_mul_matches_the_layer(dtype, width):
    torch.manual_seed(1)
    x = torch.randn(3, 2 * width, dtype=dtype) * 3
    gate = x[:, :width]
    gate[0, :6] = torch.tensor([float("inf"), -1e4, float("nan"), -100.0, 100.0, 0.0])
    want = SiluAndMul()(x)
    got = kernels().silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True) if dtype == torch.float32 else (
        _same_rounding(got, want)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2048, 896), (5, 100)])
def test_add_rms_norm_adds_into_the_residual_and_normalizes_the_sum(dtype, shape):
    """A layer's residual add and the norm after it in one pass: the residual stream becomes x + residual in place,
    as the PyTorch layer's method makes it, and the output is the kernel's rms_norm of that sum bit for bit (the
    fused decode layer adds, then calls rms_norm: a step gives the same tokens whichever path ran)."""
    torch.manual_seed(2)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data.normal_()
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype) * 4
    layer_residual = residual.clone()
    got = kernels().add_rms_norm(x, residual, norm.weight.data, norm.eps)
    want = norm.add_and_norm(x, layer_residual)
    assert torch.equal(residual, layer_residual)
    assert torch.equal(got, kernels().rms_norm(layer_residual, norm.weight.data, norm.eps))
    # against the PyTorch norm, whose float32 sum runs in another order: within two steps of the storage dtype
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


_HAS_AMX = {"amx_tile", "amx_bf16"} <= cpu_flags()
# The decode kernels as built for this CPU ("native": scores on AMX tiles where it has them), for AVX2 (another vector
# width), and, on an AMX CPU, without AMX (the AVX512-BF16 kinds' scores by vdpbf16ps; elsewhere that is "native").
DECODE_TARGETS = kernel_targets("native", "avx2") + (["no-amx"] if _HAS_AMX else [])


@pytest.mark.parametrize("target", DECODE_TARGETS)
def test_decode_attention_takes_its_scores_with_the_best_unit_the_build_has(target):
    flags = cpu_flags()
    if target == "avx2" or "avx512_bf16" not in flags:
        want = "float32"
    elif target == "native" and _HAS_AMX:
        want = "amx"
    else:
        want = "avx512-bf16"
    assert kernels(target).decode_attention_isa() == want


@pytest.mark.parametrize("target", DECODE_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 4, 32), (16, 2, 128), (24, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_matches_the_gathering_path(monkeypatch, target, dtype, heads, kv_heads, head_dim, block_size):
    monkeypatch.setattr("qwenbatch.layers.attention.kernels", lambda: kernels(target))
    torch.manual_seed(2)
    blocks = 64
    # Every slot no sequence owns is NaN: reading past a context (or through a wrong block) shows.
    cache = torch.full((2, blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    layout = StepLayout(block_size)
    free = iter(torch.randperm(blocks).tolist())
    for length in (1, block_size, block_size + 1, 5 * block_size - 3, 300):
        table = [next(free) for _ in range(-(-length // block_size))]
        for p in range(length - 1):  # the context before this step's token
            cache[:, table[p // block_size], p % block_size] = torch.randn(2, kv_heads, head_dim, dtype=dtype)
        layout.add_decode(1, table, length)
    table = [next(free) for _ in range(3)]
    layout.add_prefill([1] * 40, table, 0)  # a prompt in the same step
    n = layout.num_tokens
    q = torch.randn(n, heads, head_dim, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    # The gathering path reads padding slots (masked out, but NaN x 0 is NaN): give it a finite copy.
    want = TorchAttentionMetadata.build(layout, torch.device("cpu")).attend(q, k, v, cache.nan_to_num(), scale)
    got = KernelAttentionMetadata.build(layout, torch.device("cpu")).attend(q, k, v, cache, scale)
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# Query heads a KV head from 1 to 8 (the bf16 kernel's instances, where the CPU has AVX512-BF16) and 12 (its float32
# kernel's); blocks of 8 positions make every 16-position step of the bf16 kernel a partial one.
@pytest.mark.parametrize("target", DECODE_TARGETS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block"),
    [(14, 2, 64, 16), (16, 2, 128, 16), (4, 4, 32, 16), (10, 2, 64, 8), (4, 2, 128, 32), (24, 2, 64, 16)],
)
@pytest.mark.parametrize("threads", [2, 16])
def test_bf16_decode_attention_is_within_a_rounding_step_of_float32(target, heads, kv_heads, head_dim, block, threads):
    """The kernels take bf16 products exactly and sum in float32 (the weights unrounded), so no output element is
    further from the attention computed in float32 on the same stored values than one bfloat16 step at its head's
    largest output: the output's own rounding. With 16 threads for 8 (sequence, KV head) pairs each context is cut
    into runs whose partial sums are merged (runs past a short context's end hold nothing): the same bound holds.
    The 1,100-position context spans three of the bf16 kernel's 512-position softmax steps."""
    torch.manual_seed(3)
    lens = [1, 17, 300, 1100]
    per_seq = -(-max(lens) // block)
    tables = torch.randperm(4 * per_seq).view(4, per_seq).int()
    cache = torch.randn(2, 4 * per_seq, block, kv_heads, head_dim, dtype=torch.bfloat16)
    q = torch.randn(4, heads, head_dim, dtype=torch.bfloat16) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels(target).paged_decode_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32), 0.1)
    finally:
        torch.set_num_threads(before)
    for s, length in enumerate(lens):
        positions = torch.arange(length)
        blocks = tables[s, positions // block].long()
        k, v = (cache[i, blocks, positions % block].float() for i in (0, 1))  # [L, kv_heads, head_dim]
        grouped = q[s].float().view(kv_heads, heads // kv_heads, head_dim)
        weights = (torch.einsum("hgd,lhd->hgl", grouped, k) * 0.1).softmax(-1)
        want = torch.einsum("hgl,lhd->hgd", weights, v).reshape(heads, head_dim)
        # bf16's spacing at each head's largest output: the weights' rounding errs in absolute terms, not per element
        step = 2.0 ** (torch.floor(torch.log2(want.abs().amax(-1, keepdim=True))) - 7)
        assert bool(((got[s].float() - want).abs() <= step).all())


def test_use_cpu_kernels_swaps_norms_activations_and_rotary_keeping_weights(tiny_qwen3):
    from qwenbatch.layers.cpu_kernels import KernelRotaryEmbedding
    from qwenbatch.layers.rotary import RotaryEmbedding
    from qwenbatch.loader.hf import load_hf_model

    model = load_hf_model(tiny_qwen3, torch.float32, torch.device("cpu"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    weight = norm.weight
    swapped = use_cpu_kernels(model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    acts = [m for m in model.modules() if isinstance(m, SiluAndMul)]
    rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert swapped == len(norms) + len(acts) + len(rotary) > 1
    assert all(type(m) is KernelRotaryEmbedding for m in rotary)
    assert all(type(m) is KernelRMSNorm for m in norms) and all(type(m) is KernelSiluAndMul for m in acts)
    assert norm.weight is weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_layer_on_slices_of_the_fused_projection(dtype):
    from qwenbatch.layers.cpu_kernels import KernelRotaryEmbedding
    from qwenbatch.layers.rotary import RotaryEmbedding

    torch.manual_seed(4)
    heads, kv_heads, head_dim, tokens = 14, 2, 64, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided rows, as in the model
    positions = torch.tensor([0, 1, 2, 7, 100, 3000, 5, 6, 9])
    plain, fused = RotaryEmbedding(head_dim, 1e6), KernelRotaryEmbedding(head_dim, 1e6)
    plain.reserve(4096, torch.device("cpu"))
    fused.reserve(4096, torch.device("cpu"))
    for want, got in zip(plain(positions, dtype).apply(q, k), fused(positions, dtype).apply(q, k), strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want)


def test_the_cpu_kernels_setting_resolves_by_dtype_and_compiler(monkeypatch, fake_cuda):
    from qwenbatch import config as config_module
    from qwenbatch.config import EngineConfig

    monkeypatch.setattr(config_module, "has_cxx_compiler", lambda: True)
    assert EngineConfig(dtype="bfloat16").uses_cpu_kernels
    assert EngineConfig(dtype="float32").uses_cpu_kernels  # greedy parity holds (tests/test_model_parity.py)
    assert EngineConfig(dtype="float32", cpu_kernels="on").uses_cpu_kernels
    assert EngineConfig(dtype="float32", quantization="int8").uses_cpu_kernels
    assert not EngineConfig(dtype="bfloat16", cpu_kernels="off").uses_cpu_kernels
    monkeypatch.setattr(config_module, "has_cxx_compiler", lambda: False)
    assert not EngineConfig(dtype="bfloat16").uses_cpu_kernels  # no compiler: the PyTorch path, not an error
    with pytest.raises(ValueError, match="cpu_kernels must be auto, on or off"):
        EngineConfig(cpu_kernels="yes")
    with pytest.raises(ValueError, match="cannot have cpu_kernels off"):
        EngineConfig(quantization="int8", cpu_kernels="off")
    fake_cuda()
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", cpu_kernels="on")
    assert not EngineConfig(device="cuda").uses_cpu_kernels


def test_an_engine_on_the_cpu_kernels_decodes_as_the_pytorch_path(tiny_qwen2):
    from qwenbatch import LLM, SamplingParams

    common = dict(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=8 * 2**20)
    fused, plain = LLM(**common, cpu_kernels="on"), LLM(**common, cpu_kernels="off")
    assert isinstance(fused.engine.runner.model.model.norm, KernelRMSNorm)
    assert not isinstance(plain.engine.runner.model.model.norm, KernelRMSNorm)
    assert isinstance(fused.engine.runner._build_metadata(StepLayout(16), torch.device("cpu")), KernelAttentionMetadata)
    # what the log, bench JSON and GET /config say decodes
    assert fused.engine.runner.decode_attention == f"cpu-kernels ({kernels().decode_attention_isa()})"
    assert plain.engine.runner.decode_attention == "torch"
    # float32: only the order of the kernels' float32 sums differs, so greedy tokens (decode attention read
    # through the block tables in place, across several blocks) are the PyTorch path's.
    prompts = [[5, 9, 14, 3, 7], list(range(20, 57)), [8, 30, 6, 17, 2, 11, 4]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_kernels_that_cannot_build_fall_back_under_auto_and_fail_when_asked_for(tiny_qwen2, monkeypatch):
    from qwenbatch import LLM
    from qwenbatch import config as config_module
    from qwenbatch.layers import cpu_kernels

    def no_build(target: str = "native"):
        raise RuntimeError("qwenbatch's CPU kernels need a C++ compiler to build (g++): Python.h not found")

    monkeypatch.setattr(config_module, "has_cxx_compiler", lambda: True)  # a compiler, but a broken build
    monkeypatch.setattr(cpu_kernels, "kernels", no_build)
    common = dict(model=str(tiny_qwen2), dtype="bfloat16", kv_cache_memory=8 * 2**20)
    llm = LLM(**common)  # auto: the PyTorch layers, and it serves
    assert not isinstance(llm.engine.runner.model.model.norm, KernelRMSNorm)
    assert type(llm.engine.runner._build_metadata(StepLayout(16), torch.device("cpu"))) is TorchAttentionMetadata
    assert len(llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids) > 0
    with pytest.raises(RuntimeError, match=r"Python\.h"):
        LLM(**common, cpu_kernels="on")


def test_a_build_killed_half_way_does_not_hang_the_next_start():
    # torch's build lock is a file: a first start killed while it compiles leaves it behind, and torch alone
    # then waits on it forever at every later start.
    build_dir = Path(kernels("portable").__file__).parent  # built or loaded here: the next start only loads
    (build_dir / "lock").touch()
    code = "from qwenbatch.layers.cpu_kernels import kernels; print(kernels('portable').isa())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "portable"
    assert not (build_dir / "lock").exists()


# The loops that call qb::vec_exp, by source: SiLU (silu_and_mul), the softmax, the int8 gate_up's SiLU · up store.
@pytest.mark.parametrize("target", kernel_targets("native", "avx2"))
@pytest.mark.parametrize("source", ["cpu_ops", "decode_attention", "int8_linear"])
def test_the_exp_loops_are_built_as_vector_code(target, source):
    """Their values are the same either way, so only the machine code shows it: GCC left every one of these loops
    scalar in AVX2 builds (no vector rounding instruction in the object at all) until the kernels were built with
    -fno-trapping-math, and the AVX2 kind ran its softmax and SiLU one lane at a time."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with g++) reads the kernels' machine code"
    obj = Path(kernels(target).__file__).parent / f"{source}.o"
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True)
    # exp rounds t = x log2(e) to an integer: vroundps on 8 lanes (AVX), vrndscaleps on 16 (AVX-512)
    assert re.search(r"\b(vroundps|vrndscaleps)\b", code.stdout), f"{source}.o ({target}) has no vector rounding"


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="needs an AVX-512 CPU")
@pytest.mark.parametrize("source", ["cpu_ops", "decode_attention", "int8_linear"])
def test_the_exp_loops_are_512_bits_wide_where_the_cpu_has_avx512(source):
    """GCC's tuning for Intel's AVX-512 cores prefers 256-bit vectors: on the AMX kind every one of these loops ran
    8 lanes wide (vrndscaleps on ymm registers only) beside 16-lane intrinsics, and SiLU * up took 1.3x as long."""
    obj = Path(kernels().__file__).parent / f"{source}.o"
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True)
    assert re.search(r"\bvrndscaleps\b[^\n]*%zmm", code.stdout), f"{source}.o rounds in no 512-bit register"


def test_decode_attention_of_no_rows_returns_nothing_at_any_thread_count():
    # More threads than (sequence, KV head) pairs cut contexts into runs; with no sequence at all there is nothing
    # to cut (the plan once divided by the pairs).
    cache = torch.randn(2, 4, 16, 2, 64).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        out = kernels().paged_decode_attention(
            torch.empty(0, 14, 64).bfloat16(), cache, torch.zeros(0, 4, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), 0.125,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert out.shape == (0, 14, 64)
