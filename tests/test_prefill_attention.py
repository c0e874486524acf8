"""Our prefill attention kernels (layers/csrc/prefill_attention.cpp in bf16, prefill_attention_f32.cpp in float32):
bottom-right causal attention of a chunk on its context, within a rounding step of exact attention, and the attention
metadata that runs a step's prefill chunks in them (tests/test_prefill_choice.py: when the engine does)."""

from __future__ import annotations

import pytest
import torch

from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.layers.attention import (
    KernelAttentionMetadata,
    StepLayout,
    TorchAttentionMetadata,
    sdpa_chunk_attention,
)
from qwenbatch.layers.cpu_kernels import kernels

_FLAGS = cpu_flags()
_HAS_AMX = {"amx_tile", "amx_bf16"} <= _FLAGS
# As built for this CPU (both products on AMX tiles where it has them) and, on an AMX CPU, without AMX: the
# AVX512-BF16 kinds' vdpbf16ps products.
TARGETS = ["native"] + (["no-amx"] if _HAS_AMX else [])
DTYPES = [torch.bfloat16, torch.float32]
_NEEDS = {torch.bfloat16: "AVX512-BF16", torch.float32: "AVX2 and FMA"}


def needs_the_kernel(dtype: torch.dtype, target: str = "native") -> None:
    # Called in the tests, not at import: collecting them must not build the kernels.
    if not kernels(target).prefill_attention_isa(str(dtype).removeprefix("torch.")):
        pytest.skip(f"the {dtype} prefill kernel needs {_NEEDS[dtype]}, which this CPU lacks")


def random_qkv(q_len: int, k_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    q = torch.randn(q_len, heads, head_dim, dtype=dtype) * 3
    k = torch.randn(k_len, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(k_len, kv_heads, head_dim, dtype=dtype)
    return q, k, v


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention in float64 on the same stored values: [Lq, heads, d]."""
    q_len, heads, _ = q.shape
    k_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    kf, vf = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kf) * scale
    visible = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, vf)


# (q_len, k_len, heads, kv_heads, head_dim) for both dtypes; each adds its smallest head_dim and one of two tile widths.
SHAPES = [
    (1, 1, 14, 2, 64),  # a one-token prompt
    (50, 50, 14, 2, 64),  # a fresh prompt, not a whole tile
    (37, 300, 14, 2, 64),  # a chunk after a cached prefix
    (130, 1000, 14, 2, 64),  # a long prefix, several query and key blocks
    (100, 100, 16, 8, 128),  # Qwen3's head_dim
    (1, 257, 14, 2, 64),  # a one-token chunk after a prefix
    (45, 300, 14, 2, 64),  # a block boundary inside the diagonal: early queries see none of the last key block
    (300, 300, 14, 2, 64),  # the same in a fresh prompt
]


@pytest.mark.parametrize(
    ("q_len", "k_len", "heads", "kv_heads", "head_dim"),
    [*SHAPES, (49, 49, 4, 4, 32), (60, 200, 8, 2, 96)],  # no GQA at the smallest head_dim; 64 + 32
)
@pytest.mark.parametrize("target", TARGETS)
def test_bf16_prefill_attention_is_within_a_rounding_step_of_float32(target, q_len, k_len, heads, kv_heads, head_dim):
    """Products of bf16 values are exact in float32 and the weights are rounded to bf16 for P.V (as FlashAttention
    does on GPUs), so no output element is far from float32 attention: within 1.5 bfloat16 steps at its row's
    largest output (the weights' rounding errs in absolute terms; measured: at most 0.96 steps)."""
    needs_the_kernel(torch.bfloat16, target)
    torch.manual_seed(q_len * 7 + k_len)
    q, k, v = random_qkv(q_len, k_len, heads, kv_heads, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    got = kernels(target).prefill_attention(q, k, v, scale).double()
    want = _exact_attention(q, k, v, scale)
    step = 2.0 ** (torch.floor(torch.log2(want.abs().amax(-1, keepdim=True))) - 7)
    assert bool(((got - want).abs() <= 1.5 * step).all()), float(((got - want).abs() / step).max())


@pytest.mark.parametrize(
    ("q_len", "k_len", "heads", "kv_heads", "head_dim"),
    [*SHAPES, (49, 49, 4, 4, 16), (60, 200, 8, 2, 80)],  # no GQA at the smallest head_dim; 64 + 16
)
def test_float32_prefill_attention_is_within_float32_rounding_of_exact(q_len, k_len, heads, kv_heads, head_dim):
    """The float32 kernel's products and weights stay in float32 (its exp within 3e-7 of the true one), so it is as
    close to exact attention as SDPA's float32 flash kernel: measured at most 5.3e-6 from float64, SDPA 5.4e-6."""
    needs_the_kernel(torch.float32)
    torch.manual_seed(q_len * 7 + k_len)
    q, k, v = random_qkv(q_len, k_len, heads, kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    got = kernels().prefill_attention(q, k, v, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _exact_attention(q, k, v, scale), rtol=1e-5, atol=2e-5)


def test_float32_weights_far_below_the_row_maximum_are_zero_not_garbage():
    """Scores spread over hundreds of powers of two (peaked rows, as an attention sink gives): the kernel's exp clamps
    its exponent below 2^-126, and the weights it clamps stay as negligible as the true ones. Scores this large carry
    float32 rounding of ~1e-4 into the weights, so the bound is SDPA's float32 kernel's own distance from exact
    (measured: ours 1.37e-4, SDPA 1.41e-4)."""
    needs_the_kernel(torch.float32)
    torch.manual_seed(5)
    q, k, v = random_qkv(64, 300, 14, 2, 64, torch.float32)
    q *= 40  # scores' spread within a row: ~500 in log2 units
    want = _exact_attention(q, k, v, 0.125)
    ours = (kernels().prefill_attention(q, k, v, 0.125).double() - want).abs().max()
    sdpa = (sdpa_chunk_attention(q, k, v, 0.125).double() - want).abs().max()
    assert ours <= 2 * sdpa, (float(ours), float(sdpa))


@pytest.mark.parametrize("target", TARGETS)
def test_the_bf16_kernel_takes_its_products_with_the_best_unit_the_build_has(target):
    needs_the_kernel(torch.bfloat16, target)
    assert kernels(target).prefill_attention_isa("bfloat16") == (
        "amx" if target == "native" and _HAS_AMX else "avx512-bf16"
    )


def test_the_float32_kernel_is_built_wherever_the_cpu_has_avx2_and_fma():
    assert kernels().prefill_attention_isa("float32") == ("avx2-fma" if {"avx2", "fma"} <= _FLAGS else "")
    assert kernels().prefill_attention_isa("float16") == ""


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_as_the_model_passes_them(dtype):
    """The model hands q, k and v as views of one fused projection: rows further apart than heads * head_dim."""
    needs_the_kernel(dtype)
    torch.manual_seed(1)
    fused = torch.randn(70, (14 + 2 + 2) * 64, dtype=dtype)
    q = fused[:, : 14 * 64].view(70, 14, 64)
    k = fused[:, 14 * 64 : 16 * 64].view(70, 2, 64)
    v = fused[:, 16 * 64 :].view(70, 2, 64)
    want = kernels().prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(kernels().prefill_attention(q, k, v, 0.125), want)
    # Dimensions not adjacent in memory are made so first.
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert torch.equal(kernels().prefill_attention(q_t, k_t, v_t, 0.125), want)


_BAD_INPUTS = [
    lambda q, k: (q.half(), k.half(), k.half()),  # neither bf16 nor float32
    lambda q, k: (q, k.double(), k.double()),  # dtypes that differ
    lambda q, k: (q[..., :40], k[..., :40], k[..., :40]),  # head_dim a multiple of neither 32 nor 16
    lambda q, k: (q, k[:10], k[:10]),  # fewer keys than queries
    lambda q, k: (q[:, :13], k, k),  # heads not a multiple of kv_heads
    lambda q, k: (q, k, k[:, :1]),  # v not shaped as k
    lambda q, k: (q[0], k, k),  # not [tokens, heads, head_dim]
    lambda q, k: (q, k[:, :0], k[:, :0]),  # no KV heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", _BAD_INPUTS)
def test_shapes_it_cannot_take_are_refused(dtype, bad):
    needs_the_kernel(dtype)
    q = torch.randn(20, 14, 64, dtype=dtype)
    k = torch.randn(20, 2, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="prefill_attention"):
        kernels().prefill_attention(*bad(q, k), 0.125)


def test_a_bf16_head_dim_must_be_a_multiple_of_32():
    needs_the_kernel(torch.bfloat16)
    q, k, v = random_qkv(20, 20, 14, 2, 48, torch.bfloat16)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        kernels().prefill_attention(q, k, v, 0.125)


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_a_scale_that_is_not_positive_is_refused(scale):
    q = torch.randn(20, 14, 64)
    k = torch.randn(20, 2, 64)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        kernels().prefill_attention(q, k, k, scale)


@pytest.mark.parametrize(
    ("dtype", "target"), [(torch.bfloat16, target) for target in TARGETS] + [(torch.float32, "native")]
)
def test_a_context_read_through_cache_slots_equals_it_gathered(dtype, target):
    """A chunk after a cached prefix reads its context in place, through its slots (in any order, as a block table
    scatters them), and writes into the step's output rows: the same bits as on the gathered rows."""
    needs_the_kernel(dtype, target)
    torch.manual_seed(3)
    cache_k = torch.randn(640, 2, 64, dtype=dtype)
    cache_v = torch.randn(640, 2, 64, dtype=dtype)
    slots = torch.randperm(640)[:300]
    q = torch.randn(45, 14, 64, dtype=dtype)
    want = kernels(target).prefill_attention(q, cache_k[slots], cache_v[slots], 0.125)
    out = torch.full((50, 14, 64), float("nan"), dtype=dtype)
    got = kernels(target).prefill_attention(q, cache_k, cache_v, 0.125, slots, out[5:])
    assert got.data_ptr() == out[5:].data_ptr()
    assert torch.equal(out[5:], want)
    assert out[:5].isnan().all()  # rows outside the chunk untouched
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        kernels(target).prefill_attention(q, cache_k, cache_v, 0.125, torch.tensor([0, 640] * 30))


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, int]]:
    """(queries, keys) of each prefill_attention call in the test."""
    calls: list[tuple[int, int]] = []
    real = kernels().prefill_attention

    def recording(q, k, v, scale, slots=None, out=None):
        calls.append((len(q), len(k) if slots is None else len(slots)))
        return real(q, k, v, scale, slots, out)

    monkeypatch.setattr(kernels(), "prefill_attention", recording)
    return calls


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
def test_kernel_metadata_runs_prefill_chunks_in_the_kernel(kernel_calls, dtype, tolerance):
    """A step with decodes, a fresh prompt and a chunk after a cached prefix: both prefill spans go to the kernel,
    and the step's output is the PyTorch path's within the dtype's rounding."""
    needs_the_kernel(dtype)
    heads, kv_heads, head_dim, bs = 14, 2, 64, 16
    torch.manual_seed(0)
    cache = torch.randn(2, 40, bs, kv_heads, head_dim, dtype=dtype)
    layout = StepLayout(bs)
    layout.add_decode(3, [5, 6], 20)
    layout.add_prefill([1] * 50, [0, 1, 2, 3], 0)
    layout.add_prefill([1] * 37, list(range(10, 30)), 263)
    n = layout.num_tokens
    q = torch.randn(n, heads, head_dim, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, dtype=dtype)
    want = TorchAttentionMetadata.build(layout, torch.device("cpu")).attend(q, k, v, cache.clone(), 0.125)
    got = KernelAttentionMetadata.build(layout, torch.device("cpu"), own_prefill=True).attend(q, k, v, cache, 0.125)
    assert kernel_calls == [(50, 50), (37, 300)]  # the PyTorch reference made none
    KernelAttentionMetadata.build(layout, torch.device("cpu")).attend(q, k, v, cache, 0.125)
    assert len(kernel_calls) == 2  # without own_prefill, SDPA's flash kernel
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
