"""--quantization int8: the kernel's arithmetic, the weight format, and the engine running on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import kernel_targets
from qwenbatch import LLM, SamplingParams
from qwenbatch.config import EngineConfig
from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.int8_linear import (
    GROUP_SIZE,
    Int8Linear,
    dequantize,
    exact_groups,
    interleave_gate_up,
    is_exact,
    pack,
    pack_q5,
    quantize_linears,
    quantize_weight,
    quantize_weight_q5,
)


def reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's contract: x quantized per 32 values in float32 (scale max|x| / 127, x * (127 / max|x|)
    rounded half to even), times the int8 weight group by group, summed here in float64."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(-1, keepdim=True)
    x_q = torch.where(amax > 0, torch.round(groups * (127 / amax.clamp_min(1e-30))), 0).double()
    x_scale = (amax / 127).squeeze(-1).double()
    w = values.double().reshape(values.shape[0], k // GROUP_SIZE, GROUP_SIZE)
    dots = torch.einsum("mgi,ngi->mng", x_q, w)  # exact integers
    return (dots * x_scale[:, None, :] * scales.double()[None, :, :]).sum(-1)


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (48, 896), (160, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9])
def test_kernel_computes_the_quantized_product(target, n, k, m):
    torch.manual_seed(n * 1000 + k + m)
    weight = torch.randn(n, k) * torch.rand(n, 1)  # rows of different scales
    values, scales = quantize_weight(weight)
    x = torch.randn(m, k) * 3
    x[0, :GROUP_SIZE] = 0  # an all-zero group has scale 0
    packed, packed_scales = pack(values, scales)
    y = kernels(target).int8_linear(x, packed, packed_scales, None, n)
    want = reference(x, values, scales)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_and_writes_half_precision_as_float32_rounded(target, dtype):
    torch.manual_seed(3)
    values, scales = quantize_weight(torch.randn(48, 96))
    packed, packed_scales = pack(values, scales)
    x, bias = torch.randn(3, 96).to(dtype), torch.randn(48)
    y = kernels(target).int8_linear(x, packed, packed_scales, bias, 48)
    assert y.dtype == dtype
    want = kernels(target).int8_linear(x.float(), packed, packed_scales, bias, 48).to(dtype)
    assert torch.equal(y, want)


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize("bits", [8, 5])
def test_kernel_of_no_rows_returns_no_rows(target, bits):
    # Decode steps' row blocks stream their tiles: a call of no rows must not start one (it read and wrote rows that
    # do not exist).
    values, scales = (quantize_weight_q5 if bits == 5 else quantize_weight)(torch.randn(48, 96))
    packed, packed_scales = (pack_q5 if bits == 5 else pack)(values, scales)
    y = kernels(target).int8_linear(torch.empty(0, 96), packed, packed_scales, torch.randn(48), 48, bits)
    assert y.shape == (0, 48) and y.dtype == torch.float32


def test_native_kernel_is_what_the_cpu_supports():
    flags = cpu_flags()
    native = "avx512-vnni" if {"avx512f", "avx512_vnni"} <= flags else "avx2" if "avx2" in flags else "portable"
    assert kernels("native").isa() == native
    for target in kernel_targets("avx2", "portable"):
        assert kernels(target).isa() == target


def test_quantize_weight_holds_a_q8_0_tensor_exactly():
    # Q8_0: int8 values in [-127, 127] times one float16 scale per 32, each block reaching 127 in magnitude.
    torch.manual_seed(0)
    values = torch.randint(-127, 128, (32, 128), dtype=torch.int8)
    values[:, ::GROUP_SIZE] = 127
    scales = (torch.rand(32, 128 // GROUP_SIZE) * 0.01 + 1e-4).half()
    got_values, got_scales = quantize_weight(dequantize(values, scales))
    assert torch.equal(got_values, values)
    assert torch.equal(got_scales, scales)


def q5_0_blocks(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks as GGUF's Q5_0 writes them: values in [-16, 15], each block reaching -16, float16 scales of any sign."""
    values = torch.randint(-16, 16, (n, k), dtype=torch.int8)
    values[:, 5::GROUP_SIZE] = -16
    scales = (torch.randn(n, k // GROUP_SIZE) * 0.01).half()
    scales[0, 0] = 0  # an all-zero block
    values[0, :GROUP_SIZE] = 0
    return values, scales


def test_quantize_weight_q5_holds_a_q5_0_tensor_exactly_and_rejects_others():
    torch.manual_seed(0)
    values, scales = q5_0_blocks(32, 128)
    weight = dequantize(values, scales)
    got_values, got_scales = quantize_weight_q5(weight)
    assert is_exact(weight, got_values, got_scales)
    assert torch.equal(got_values, values)
    assert torch.equal(got_scales.float().abs(), scales.float().abs())  # a zero block's scale may be -0
    assert not is_exact(torch.randn(32, 128), *quantize_weight_q5(torch.randn(32, 128)))
    bf16_copy = weight.bfloat16().float()  # rounded first, as a bf16 load would: no longer Q5_0
    assert not is_exact(bf16_copy, *quantize_weight_q5(bf16_copy))


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (48, 896), (160, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 9])
def test_5_bit_layout_gives_the_int8_layouts_result(target, n, k, m):
    torch.manual_seed(n + k + m)
    values, scales = q5_0_blocks(n, k)
    x = torch.randn(m, k)
    five = kernels(target).int8_linear(x, *pack_q5(values, scales), None, n, 5)
    eight = kernels(target).int8_linear(x, *pack(values, scales), None, n, 8)
    assert torch.equal(five, eight)
    want = reference(x, values, scales)
    torch.testing.assert_close(five.double(), want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize("bits", [8, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("n", [96, 80])  # 80: a task's last tile stored alone, not in a pair
def test_fused_silu_and_mul_equals_the_unfused_layer_bit_for_bit(target, bits, dtype, m, n):
    # A gated MLP's gate_up with SiLU(gate) * up applied as the kernel stores each tile: the same values, in
    # every dtype, as the plain product followed by the silu_and_mul kernel.
    torch.manual_seed(bits * 100 + m)
    values, scales = q5_0_blocks(n, 64)  # n / 2 gate rows, then n / 2 up rows
    layout = pack_q5 if bits == 5 else pack
    ops = kernels(target)
    x, bias = (torch.randn(m, 64) * 2).to(dtype), torch.randn(n)
    unfused = ops.silu_and_mul(ops.int8_linear(x, *layout(values, scales), bias, n, bits))
    order = interleave_gate_up(n)
    fused = ops.int8_linear(x, *layout(values[order], scales[order]), bias[order], n, bits, True)
    assert fused.shape == (m, n // 2) and fused.dtype == dtype
    assert torch.equal(fused, unfused)


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(64, 128, bias=False)
        self.down_proj = nn.Linear(64, 64, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def test_quantize_linears_fuses_silu_and_mul_into_a_gated_mlps_gate_up():
    torch.manual_seed(6)
    mlp, x = GatedMLP(), torch.randn(5, 64)
    want = Int8Linear(mlp.down_proj)(kernels().silu_and_mul(Int8Linear(mlp.gate_up_proj)(x)))
    assert quantize_linears(mlp) == 2
    assert mlp.gate_up_proj.silu_and_mul and not mlp.down_proj.silu_and_mul
    assert isinstance(mlp.act_fn, nn.Identity)
    assert torch.equal(mlp(x), want)


def test_int8_linear_stores_q5_0_weights_in_5_bits_only_where_asked():
    torch.manual_seed(4)
    values, scales = q5_0_blocks(50, 64)
    dense = nn.Linear(64, 50)
    dense.weight.data = dequantize(values, scales)
    five, eight = Int8Linear(dense, five_bit=True), Int8Linear(dense, five_bit=False)
    assert (five.bits, five.q5_exact, eight.bits, eight.q5_exact) == (5, True, 8, True)
    assert five.packed_weight.numel() == 64 * 64 * 5 // 8  # rows padded to 64
    x = torch.randn(3, 64)
    assert torch.equal(five(x), eight(x))
    want = dense(x).detach()
    torch.testing.assert_close(five(x), want, rtol=0, atol=0.02 * float(want.abs().max()))
    generic = Int8Linear(nn.Linear(64, 50), five_bit=True)  # not Q5_0: the int8 rule, 8 bits
    assert (generic.bits, generic.q5_exact, generic.exact) == (8, False, False)


def test_a_layer_of_q5_0_and_q8_0_rows_is_held_exactly_in_8_bits():
    # The default model's fused qkv: q and k rows are Q5_0 blocks, v rows (in half the layers) Q8_0 ones.
    torch.manual_seed(6)
    q8_values = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    q8_values[:, ::GROUP_SIZE] = 127
    q8 = dequantize(q8_values, (torch.rand(16, 2) * 0.01 + 1e-4).half())
    q5 = dequantize(*q5_0_blocks(32, 64))
    dense = nn.Linear(64, 48, bias=False)
    dense.weight.data = torch.cat([q5, q8])
    layer = Int8Linear(dense, five_bit=True)
    assert (layer.bits, layer.q5_exact, layer.exact) == (8, False, True)
    values, scales = quantize_weight(dense.weight.data)
    assert torch.equal(dequantize(values, scales), dense.weight.data)


def test_the_kernels_quantizer_follows_the_reference_rules():
    torch.manual_seed(8)
    q8_values = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    q8_values[:, ::GROUP_SIZE] = -127
    weight = torch.cat(
        [
            torch.randn(32, 64),  # neither rule exact
            dequantize(*q5_0_blocks(32, 64)),
            dequantize(q8_values, (torch.rand(16, 2) * 0.01 + 1e-4).half()),
            torch.zeros(16, 64),  # scale 0
            torch.randn(16, 64).bfloat16().float(),
        ]
    )
    weight[-1, :GROUP_SIZE] = torch.tensor([0.5, -0.5] * 16)  # a tie in magnitude: the first one sets Q5_0's sign
    weight[-2, :GROUP_SIZE] = torch.arange(GROUP_SIZE) * 0.25 - 4  # values halfway between steps round to even
    values, scales, q5, exact = kernels().quantize_groups(weight)
    want_values, want_scales = quantize_weight(weight)
    assert torch.equal(values, want_values) and torch.equal(scales, want_scales)
    q5_values, q5_scales = quantize_weight_q5(weight)
    assert torch.equal(q5, exact_groups(weight, q5_values, q5_scales))
    assert torch.equal(exact, exact_groups(weight, values, scales))
    assert bool(q5[32:64].all()) and not bool(q5[:32].any()) and bool(exact[32:96].all())


def test_quantize_weight_error_is_half_a_step_at_most():
    torch.manual_seed(1)
    weight = torch.randn(64, 256)
    values, scales = quantize_weight(weight)
    step = scales.float().repeat_interleave(GROUP_SIZE, dim=1)
    assert bool(((dequantize(values, scales) - weight).abs() <= step / 2 + 1e-6).all())
    assert int(values.abs().max()) <= 127


def test_int8_linear_pads_rows_and_adds_the_bias():
    torch.manual_seed(2)
    dense = nn.Linear(64, 50)  # 50 rows: padded to 64 inside, sliced back
    layer = Int8Linear(dense)
    x = torch.randn(2, 3, 64)
    y = layer(x)
    assert y.shape == (2, 3, 50)
    want = dense(x).detach()
    torch.testing.assert_close(y, want, rtol=0, atol=0.05 * float(want.abs().max()))


def test_engine_runs_int8_and_stays_close_to_the_float_model(tiny_qwen2):
    common = dict(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=8 * 2**20)
    dense, quant = LLM(**common), LLM(**common, quantization="int8")
    assert quant.engine.runner.linear_kernels.startswith("int8-")
    assert not any(isinstance(m, nn.Linear) for m in quant.engine.runner.model.modules())
    sequence = [5, 9, 14, 3, 7, 21, 11, 4, 8, 30, 6, 17]
    want = dense.engine.runner.sequence_logits(sequence)
    got = quant.engine.runner.sequence_logits(sequence)
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 0.05 * spread
    out = quant.generate([sequence], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def test_bad_quantization_settings_are_refused(fake_cuda):
    with pytest.raises(ValueError, match="quantization must be none or int8"):
        EngineConfig(quantization="int4")
    fake_cuda()
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda")


def test_a_layer_packed_in_slices_equals_one_packed_whole():
    torch.manual_seed(5)
    dense = nn.Linear(64, 9000, bias=False)  # more rows than one slice: packed in three, then padded
    layer = Int8Linear(dense)
    padded = torch.nn.functional.pad(dense.weight.detach(), (0, 0, 0, layer.padded_out - 9000))
    whole_weight, whole_scales = pack(*quantize_weight(padded))
    assert torch.equal(layer.packed_weight, whole_weight)
    assert torch.equal(layer.packed_scales, whole_scales)


def test_engine_keeps_a_q5_0_gguf_exact_in_bfloat16(tiny_qwen2, tmp_path):
    from gguf_writer import write_gguf

    path = tmp_path / "q5.gguf"
    expected = write_gguf(tiny_qwen2, path, qtype="Q5_0")
    llm = LLM(model=str(path), dtype="bfloat16", quantization="int8", kv_cache_memory=8 * 2**20)
    layers = dict(llm.engine.runner.model.named_modules())
    int8_layers = {name: m for name, m in layers.items() if isinstance(m, Int8Linear)}
    assert int8_layers and all(m.q5_exact and m.exact for m in int8_layers.values())
    # Quantized from the file's float32 values, one layer at a time: the model itself loaded in bfloat16.
    assert all(p.dtype == torch.bfloat16 for p in llm.engine.runner.model.parameters())
    five_bit = kernels().isa() != "portable"
    assert all(m.bits == (5 if five_bit else 8) for m in int8_layers.values())
    # The layer computes with the file's blocks, not with a bfloat16 rounding of them.
    layer = int8_layers["model.layers.0.mlp.down_proj"]
    values, scales = quantize_weight_q5(torch.from_numpy(expected["model.layers.0.mlp.down_proj.weight"]))
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
    want = kernels().int8_linear(x, *pack(values, scales), None, layer.out_features, 8)
    assert torch.equal(layer(x), want)


@pytest.fixture
def threads():
    """Sets torch's thread count for one test, then puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_a_many_core_machine_gets_work_for_every_thread_on_narrow_layers():
    # The default model's down and o projections have 896 outputs: 56 tiles. Cut by tiles alone (14 runs of 4)
    # they kept at most 14 of a 64-core machine's threads busy; rows and shorter runs give every thread tasks.
    ops = kernels()
    for m, k, threads_ in [(2048, 4864, 64), (512, 896, 32), (64, 4864, 64), (81, 896, 64)]:
        tiles_per_task, runs, rows_per_block, blocks = ops.int8_linear_tasks(m, 896, k, threads_)
        assert runs * blocks >= threads_
        assert runs * tiles_per_task >= 56 and rows_per_block % 4 == 0
        # floor(m / rows) blocks, the last taking the remainder: none shorter than a block, none dropped
        assert blocks * rows_per_block <= m < (blocks + 1) * rows_per_block
        assert tiles_per_task >= 2 and rows_per_block >= 16  # the AVX-512 kernel's widest tile block; enough rows
    assert ops.int8_linear_tasks(1, 896, 4864, 64) == (1, 56, 1, 1)  # a decode step's down: every tile a task
    # Where tiles alone give each thread several tasks, nothing changes: 2 threads run as they always did.
    assert ops.int8_linear_tasks(2048, 896, 4864, 2) == (4, 14, 2048, 1)
    assert ops.int8_linear_tasks(2048, 9728, 896, 64) == (2, 304, 2048, 1)
    # A call too small to be worth waking threads for stays one task; so does one thread's, and an empty layer's.
    assert ops.int8_linear_tasks(1, 64, 896, 64) == (4, 1, 1, 1)
    assert ops.int8_linear_tasks(2048, 64, 896, 1) == (4, 1, 2048, 1)
    assert ops.int8_linear_tasks(64, 0, 896, 8)[3] == 1 and ops.int8_linear_tasks(64, 64, 0, 8)[3] == 1


@pytest.mark.parametrize("target", kernel_targets("native", "avx2", "portable"))
@pytest.mark.parametrize(("bits", "silu_and_mul"), [(8, False), (5, False), (5, True), (8, True)])
@pytest.mark.parametrize("m", [1, 6, 40, 81, 150])
def test_every_thread_count_gives_the_same_result_bit_for_bit(threads, target, bits, silu_and_mul, m):
    # Each output is one task's sum in one order however the call is cut, so thread counts that cut it into row
    # blocks and short tile runs (16 threads) or not at all (1) agree exactly, and with the quantized product.
    torch.manual_seed(bits * 1000 + m)
    n, k = 256, 2048  # 16 tiles: 1 thread, runs of 4 and all rows; 16 threads, shorter runs, and row blocks from 40
    plans = {count: kernels().int8_linear_tasks(m, n, k, count) for count in (1, 3, 16)}
    assert plans[1] == (4, 4, m, 1) and plans[16] != plans[1]
    values, scales = q5_0_blocks(n, k)
    layout = pack_q5 if bits == 5 else pack
    order = interleave_gate_up(n) if silu_and_mul else torch.arange(n)
    weight = layout(values[order], scales[order])
    x, bias = torch.randn(m, k).bfloat16(), torch.randn(n)
    ops = kernels(target)
    results = []
    for count in (1, 3, 16):
        threads(count)
        results.append(ops.int8_linear(x, *weight, bias[order], n, bits, silu_and_mul))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    if not silu_and_mul:
        want = reference(x, values, scales) + bias.double()
        torch.testing.assert_close(results[0].double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
