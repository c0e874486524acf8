"""The fused CPU ops (layers/csrc/cpu_ops.cpp) give what the PyTorch layers they replace give."""

from __future__ import annotations

import pytest
import torch

from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.attention import KernelAttentionMetadata, StepLayout, TorchAttentionMetadata
from qwenbatch.layers.cpu_kernels import KernelRMSNorm, KernelSiluAndMul, kernels, use_cpu_kernels
from qwenbatch.layers.norm import RMSNorm


def _same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """In half precision the kernel rounds where the layer does (float32 inside, then the storage dtype), so
    all but a few elements whose float32 sums differ in the last bit are bitwise equal, and none is far."""
    torch.testing.assert_close(got, want)
    assert float((got == want).float().mean()) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 896), (5, 64), (3, 4, 128)])
def test_rms_norm_matches_the_layer(dtype, shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(shape, dtype=dtype) * 4
    want = norm(x)
    got = kernels().rms_norm(x, norm.weight.data, norm.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5) if dtype == torch.float32 else _same_rounding(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_layer(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 2 * 4864, dtype=dtype) * 3
    want = SiluAndMul()(x)
    got = kernels().silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6) if dtype == torch.float32 else _same_rounding(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 4, 32), (16, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_matches_the_gathering_path(dtype, heads, kv_heads, head_dim, block_size):
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
