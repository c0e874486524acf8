// One decoder layer of a step in which every row decodes, in one call: at batch 1 a layer's ~35 PyTorch and
// Python operations around its kernels cost about as much as its attention (~3 ms of a 20 ms step), so the
// layer is sequenced here. Each stage is the kernel the unfused layer calls, with the same rounding steps;
// each residual add runs in the norm after it (add_rms_norm), as in the layer's own forward.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>

at::Tensor LayerLinear::operator()(const at::Tensor& x) const {
  if (int8.has_value()) return (*int8)(x);
  TORCH_CHECK(onednn_weight.has_value(), "decode_layer: a linear with neither int8 nor oneDNN weights");
  // Boxed, as torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") is called from Python: no C++ signature
  // of the operator to keep in step with torch's.
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, *onednn_weight, onednn_bias, std::string("none"),
                          c10::List<c10::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

namespace {

// K and V rows of this step ([D, kv_heads * head_dim] each, contiguous) into their cache slots.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  const int64_t rows = k.size(0), width = k.size(1), bytes = width * k.element_size();
  const int64_t half = kv_cache.numel() / 2;
  auto* k_cache = static_cast<char*>(kv_cache.data_ptr());
  auto* v_cache = k_cache + half * kv_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(k_cache + slots[r] * bytes, static_cast<const char*>(k.data_ptr()) + r * bytes, bytes);
    std::memcpy(v_cache + slots[r] * bytes, static_cast<const char*>(v.data_ptr()) + r * bytes, bytes);
  }
}

}  // namespace

// The layer on the hidden states x + residual (x alone where residual is undefined), as the model's layers take
// them: returns the MLP's output and the residual stream it is still to be added to (residual, or x where it is
// undefined, updated in place), each residual add run inside the norm after it (add_rms_norm), as in the layer's
// own forward. x: [D, hidden], one decoding row per sequence; cos, sin: [D, head_dim] (any leading view); kv_cache:
// [2, blocks, block_size, kv_heads, head_dim]; slot_mapping: int64 [D]; block_tables: int32 [D, max_blocks];
// lens: int32 [D] (context lengths including this step's token).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const DecodeLayerWeights& layer,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == x.scalar_type() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == x.size(0),
              "decode_layer: x [D, hidden] contiguous, a contiguous cache in x's dtype, int64 slots for each row");
  const int64_t D = x.size(0), hd = layer.head_dim;
  const int64_t q_size = layer.heads * hd, kv_size = layer.kv_heads * hd;
  at::Tensor stream = residual.has_value() ? *residual : x;
  const at::Tensor normed = residual.has_value() ? add_rms_norm(x, stream, layer.input_norm, layer.eps)
                                                 : rms_norm(x, layer.input_norm, layer.eps);
  const at::Tensor qkv = layer.qkv(normed);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({D, layer.heads, hd});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({D, layer.kv_heads, hd});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).contiguous();
  if (layer.q_norm.has_value()) {
    q = rms_norm(q, *layer.q_norm, layer.eps);
    k = rms_norm(k, *layer.k_norm, layer.eps);
  }
  q = rotary(q, cos, sin);
  k = rotary(k, cos, sin);
  write_kv(k.view({D, kv_size}), v, kv_cache, slot_mapping);
  const at::Tensor attn = paged_decode_attention(q, kv_cache, block_tables, lens, layer.scale);
  const at::Tensor h = layer.o(attn.view({D, q_size}));
  const at::Tensor gate_up = layer.gate_up(add_rms_norm(h, stream, layer.post_attention_norm, layer.eps));
  return {layer.down(layer.gate_up.silu_and_mul() ? gate_up : silu_and_mul(gate_up)), stream};
}

// Every decoder layer of the step in turn, layers[i] on kv_caches[i], from the embeddings x: the last layer's
// (output, residual), as the model's loop over decode_layer calls returns them. One call a step instead of one a
// layer, which cost ~60 us each at batch 1 (1.46 ms of a 24.9 ms step, AVX2 kind): ~15 of Python, the rest the
// OpenMP worker waking after each gap between kernel calls.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const std::vector<DecodeLayerWeights>& layers, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& lens) {
  TORCH_CHECK(!layers.empty() && layers.size() == kv_caches.size(), "decode_layers: a KV cache for each layer");
  at::Tensor h = x;
  c10::optional<at::Tensor> residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [out, stream] = decode_layer(h, residual, layers[i], cos, sin, kv_caches[i], slot_mapping, block_tables, lens);
    h = std::move(out);
    residual = std::move(stream);
  }
  return {h, *residual};
}
