"""A decoder layer run by one kernel call (``csrc/decode_layer.cpp``) in steps where every row decodes.

At batch 1 a layer's ~35 PyTorch and Python operations around its kernels (module calls, views, the split of
qkv, the cache write, the residual adds) cost ~3 ms of a ~20 ms step, about as much as its attention; the C++
layer sequences the same kernels with the same rounding. Steps with a prompt in them keep the layer's own
forward. Layers whose linears are all Int8Linear or oneDNN's PackedLinear are fused: on the AMX kind, where
oneDNN's bf16 linears are fast, the host's serial share of a bf16 decode step had the second core waiting a
third of the time. Where every layer of a model is fused, a FusedDecodeStack runs them all in one call a step.
"""

from __future__ import annotations

from torch import nn

from qwenbatch.layers.attention import AttentionMetadata, KernelAttentionMetadata
from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.int8_linear import Int8Linear
from qwenbatch.layers.linear import PackedLinear, row_bucket
from qwenbatch.layers.rotary import Rope

FUSABLE_LINEARS = (Int8Linear, PackedLinear)


def _layer_linear(linear: Int8Linear | PackedLinear):
    weight = kernels().LayerLinear()
    if isinstance(linear, Int8Linear):
        weight.int8 = kernels().Int8Weight(
            linear.packed_weight,
            linear.packed_scales,
            linear.bias,
            linear.padded_out,
            linear.out_features,
            linear.bits,
            linear.silu_and_mul,
        )
    else:
        weight.onednn_weight, weight.onednn_bias = linear.packed_weight, linear.bias
    return weight


class FusedDecodeLayer:
    """Runs a Qwen decoder layer (``self_attn``, ``mlp`` and their norms, read once here) for decode-only steps
    of the CPU kernels' attention; ``accepts`` tells which steps those are."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        weights = kernels().DecodeLayerWeights()
        weights.input_norm = layer.input_layernorm.weight
        weights.post_attention_norm = layer.post_attention_layernorm.weight
        if attn.q_norm is not None:
            weights.q_norm, weights.k_norm = attn.q_norm.weight, attn.k_norm.weight
        weights.qkv, weights.o = _layer_linear(attn.qkv_proj), _layer_linear(attn.o_proj)
        weights.gate_up, weights.down = _layer_linear(mlp.gate_up_proj), _layer_linear(mlp.down_proj)
        weights.heads, weights.kv_heads, weights.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        weights.eps, weights.scale = layer.input_layernorm.eps, attn.scale
        self.weights = weights
        self._gate_up = mlp.gate_up_proj  # an int8 one's dense_from_rows (layers/int8_large_m.py), read at each step
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self._packed = [m for m in linears if isinstance(m, PackedLinear)]  # their pieces_at, read at each step

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Decode-only steps of the CPU kernels' attention, of fewer rows than the int8 linears run dense from and
        of a row count that no packed linear runs in pieces (oneDNN would run it on one thread, layers/
        packed_rows.py; the kernel calls oneDNN whole): for those, the layer's own forward."""
        if not isinstance(meta, KernelAttentionMetadata) or meta.prefills or meta.num_decodes == 0:
            return False
        dense_from = getattr(self._gate_up, "dense_from_rows", None)
        if dense_from is not None and meta.num_decodes >= dense_from:
            return False
        bucket = row_bucket(meta.num_decodes)
        return not any(bucket in m.pieces_at for m in self._packed)

    def __call__(self, x, residual, rope: Rope, kv_cache, meta: KernelAttentionMetadata):
        """The layer's forward (``QwenDecoderLayer.forward``): (output, residual) for ``x + residual``."""
        return kernels().decode_layer(
            x,
            residual,
            self.weights,
            rope.cos,
            rope.sin,
            kv_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_lens,
        )


class FusedDecodeStack:
    """All the decoder layers of a model (each with its FusedDecodeLayer) in one kernel call, for the steps every
    layer ``accepts``. A call a layer cost ~60 us each at batch 1: ~15 of Python, the rest the OpenMP worker waking
    after each gap between kernel calls (AVX2 kind: 1.46 ms of a 24.9 ms step of the default model,
    benchmarks/decode_stack_ab.py)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self._layers = layers  # each one's fused_decode is read at each step: a layer can be unfused later

    def accepts(self, meta: AttentionMetadata) -> bool:
        """The steps every layer's FusedDecodeLayer accepts (all of them still fused)."""
        return all(layer.fused_decode is not None and layer.fused_decode.accepts(meta) for layer in self._layers)

    def __call__(self, x, rope: Rope, kv_caches: list, meta: KernelAttentionMetadata):
        """The layers' loop (``QwenModel.forward``) from the embeddings ``x``: the last layer's (output, residual)."""
        return kernels().decode_layers(
            x,
            [layer.fused_decode.weights for layer in self._layers],
            rope.cos,
            rope.sin,
            kv_caches,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_lens,
        )


def fusable(layer: nn.Module) -> bool:
    """A decoder layer with a dense MLP (not a mixture of experts) whose four linears are Int8Linear or
    PackedLinear."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or not hasattr(mlp, "gate_up_proj"):
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return all(isinstance(m, FUSABLE_LINEARS) for m in linears)


def fuse_decode_layers(model: nn.Module) -> int:
    """Give every fusable decoder layer of ``model`` its FusedDecodeLayer (``layer.fused_decode``), and the
    decoder (``model.model.fused_decode``) a FusedDecodeStack where every layer is; returns how many layers. The
    layers keep their modules: steps with prompts run them as before."""
    layers = list(model.model.layers)
    for layer in layers:
        if fusable(layer):
            layer.fused_decode = FusedDecodeLayer(layer)
    fused = sum(layer.fused_decode is not None for layer in layers)
    if layers and fused == len(layers):
        model.model.fused_decode = FusedDecodeStack(layers)
    return fused
