"""Load-time layout of a model's layers for the CPU it runs on: int8 or oneDNN-prepacked linears, and the
fused CPU kernels. Done once after the weights are loaded, so the model runner only runs what it is given."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from qwenbatch.layers import packed_rows
from qwenbatch.layers.linear import onednn_available, pack_linears
from qwenbatch.layers.prefill_choice import SDPA_UNTIMED, PrefillAttentionChoice, choose_prefill_attention
from qwenbatch.loader.heap import release_freed_heap
from qwenbatch.loader.hf import CheckpointReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelKernels:
    """What ``prepare_kernels`` chose; ``linear_kernels`` is recorded in the log and in bench JSON."""

    linear_kernels: str  # e.g. "torch", "onednn-prepacked-bfloat16", "int8-avx512vnni", "inductor"
    cpu_kernels: bool  # norms, SiLU * up, RoPE and attention run in layers/csrc (the int8 path)
    compiled: bool = False  # the runner compiles the model (--compile); its linears stay nn.Linear for inductor
    # With cpu_kernels: the faster prefill attention on this CPU, timed at load (layers/prefill_choice.py).
    prefill_attention: PrefillAttentionChoice = SDPA_UNTIMED


def int8_quantized_weights(model: nn.Module) -> set[str]:
    """The parameters that ``--quantization int8`` replaces by int8 copies read from the checkpoint: the weights of
    the linears the kernel supports (not a tied LM head's, which is the embedding's) and the experts' stacks. The
    loader leaves them unread."""
    from qwenbatch.layers.cpu_experts import int8_experts_supported
    from qwenbatch.layers.int8_linear import int8_supported
    from qwenbatch.layers.moe import GroupedExperts

    quantized = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and int8_supported(m)}
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts) and int8_experts_supported(m)]
    quantized |= {id(p) for m in experts for p in m.parameters()}
    kept = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in quantized - kept}


def prepare_kernels(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    cpu_kernels: bool,
    required: bool = True,
    compile: bool = False,
    checkpoint: CheckpointReader | None = None,
) -> ModelKernels:
    """Swap ``model``'s layers in place for the fastest kernels this CPU has (nothing changes on CUDA).

    With ``cpu_kernels`` the norms, SiLU * up, RoPE and decode attention run in our fused CPU kernels
    (layers/cpu_kernels.py: a small step is otherwise mostly PyTorch per-op overhead and decode attention's gather),
    and prefill attention (bf16 or float32) in ours or SDPA's flash kernel, whichever is faster here (timed on the
    model's heads); int8 needs them. A bf16 engine's int8 linears run as dense bf16 matmuls from the row count at
    which that was timed faster (layers/int8_large_m.py). Linears that stay dense are prepacked for oneDNN where it
    has a fast path for ``dtype``; in bf16, the row counts at which oneDNN would run one on a single thread run in
    pieces (layers/packed_rows.py, timed). Kernels that fail to build raise RuntimeError if ``required``, else the
    PyTorch layers stay (with a warning). With int8 each linear is quantized from its weights as ``checkpoint``
    holds them, in float32 (the model's copy may be rounded), a slice at a time. With ``compile`` only the LM head
    (run outside the compiled graph) is prepacked: inductor packs the rest itself when it freezes the weights. A
    mixture of experts' experts are packed, or with int8 quantized from the checkpoint too (layers/cpu_experts.py).
    """
    if compile:
        packed = onednn_available(dtype, device) and pack_linears(
            model, keep=lambda linear: linear is not model.lm_head
        )
        return ModelKernels(
            f"inductor+lm-head-onednn-prepacked-{str(dtype).removeprefix('torch.')}" if packed else "inductor",
            False,
            True,
        )
    linear_kernels = "torch"
    if cpu_kernels:
        from qwenbatch.layers.cpu_kernels import use_cpu_kernels

        try:
            use_cpu_kernels(model)
        except RuntimeError as e:
            if required:
                raise
            logger.warning("CPU kernels unavailable, running PyTorch's layers instead (--cpu-kernels off): %s", e)
            cpu_kernels = False
    prefill_attention, dense_choice = SDPA_UNTIMED, None
    if cpu_kernels:
        cfg = model.config
        prefill_attention = choose_prefill_attention(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
    if quantization == "int8":
        from qwenbatch.layers.cpu_experts import Int8Experts, int8_experts_supported, replace_experts
        from qwenbatch.layers.cpu_kernels import kernels
        from qwenbatch.layers.int8_linear import five_bit_available, quantize_linears

        quantize_linears(model, None if checkpoint is None else checkpoint.read)
        five_bit = five_bit_available()

        def int8_experts(name: str, experts) -> nn.Module:
            if not int8_experts_supported(experts):
                return experts  # loaded in full (int8_quantized_weights), packed below
            if checkpoint is None:
                return Int8Experts(experts, five_bit)
            gate_up, down = f"{name}.gate_up_proj", f"{name}.down_proj"
            read = lambda e: (checkpoint.read_expert(gate_up, e), checkpoint.read_expert(down, e))  # noqa: E731
            quantized = Int8Experts(experts, five_bit, read)
            # Each expert's float32 temporaries leave holes among the packed weights that malloc keeps: handed back
            # a layer at a time, the peak is the int8 model's (8 of Qwen3-30B-A3B's layers: 7.0 GiB, not 12.5).
            release_freed_heap()
            return quantized

        replace_experts(model, int8_experts)
        linear_kernels = f"int8-{kernels().isa()}"
        if dtype == torch.bfloat16:
            from qwenbatch.layers import int8_large_m

            large_m = int8_large_m.choose_int8_large_m(int8_large_m.first_mlp_linears(model))
            int8_large_m.apply(model, large_m)
            dense_choice = large_m.describe()
    if onednn_available(dtype, device):
        from qwenbatch.layers.cpu_experts import PackedExperts, replace_experts

        replace_experts(model, lambda name, experts: PackedExperts(experts))  # where int8 left them as loaded
    if onednn_available(dtype, device) and pack_linears(model):  # what int8 left dense, or every linear
        packed = f"onednn-prepacked-{str(dtype).removeprefix('torch.')}"
        linear_kernels = packed if quantization == "none" else f"{linear_kernels}+{packed}"
        linears = packed_rows.prefill_linears(model)
        if dtype == torch.bfloat16 and linears:
            pieces = packed_rows.choose_row_pieces(linears)
            packed_rows.apply(linears, pieces)
            linear_kernels = f"{linear_kernels}, {pieces.describe()}"
    if cpu_kernels:
        from qwenbatch.layers.fused_decode import fuse_decode_layers

        fused = fuse_decode_layers(model)
        calls = "all in one call a step" if model.model.fused_decode is not None else "one call a layer"
        logger.info("%d decoder layers run decode-only steps in the fused kernel, %s", fused, calls)
    if dense_choice is not None:
        linear_kernels = f"{linear_kernels}, {dense_choice}"
    from qwenbatch.layers.cpu_experts import Int8Experts, PackedExperts

    experts = sorted({type(m).__name__ for m in model.modules() if isinstance(m, Int8Experts | PackedExperts)})
    if experts:  # a mixture of experts: which kernel runs them
        linear_kernels = f"{linear_kernels}, experts: {' and '.join(experts)}"
    return ModelKernels(linear_kernels, cpu_kernels, prefill_attention=prefill_attention)
