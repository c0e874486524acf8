// The CPU kernels module's functions, for bindings.cpp and for kernels that call the others.
#pragma once
// ATen's Tensor alone, not torch/types.h or torch/extension.h: each source that included torch/types.h took ~22 s
// to build, ~9 s with Tensor.h and the one operator header it calls (ATen/ops/empty.h); only bindings.cpp includes
// pybind11, through torch/csrc/utils/pybind.h (the whole C++ frontend of torch/extension.h cost it ~20 s more).
#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t bits, bool silu_and_mul);
std::string isa();
at::Tensor int8_dequantize(const at::Tensor& w, const at::Tensor& scales, int64_t N, int64_t K, int64_t bits,
                           bool gate_up_halves);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& weight);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// residual += x in place (rounded to their dtype); returns RMSNorm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lens, double scale);
// The bf16 decode kernel's scores: "amx" (tiles), "avx512-bf16" (vdpbf16ps), or "float32" (only the float32 kernel).
std::string decode_attention_isa();
// What prefill_attention takes its two products with in `dtype` ("bfloat16" or "float32"): "amx" (tiles),
// "avx512-bf16" (vdpbf16ps), "avx2-fma", or "" where it was not built for that dtype.
std::string prefill_attention_isa(const std::string& dtype);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             const c10::optional<at::Tensor>& slots, const c10::optional<at::Tensor>& out);
std::tuple<at::Tensor, at::Tensor> greedy_tokens(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor> mask_to_allowed(const at::Tensor& logits, const at::Tensor& bits);
// Each row's token drawn at random after temperature, top-k, top-p and min-p, or its argmax, after its penalties and
// suppressed ids (sampling.cpp).
std::tuple<at::Tensor, at::Tensor> sample_tokens(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform,
    const at::Tensor& repetition, const at::Tensor& presence, const at::Tensor& frequency,
    const at::Tensor& prompt_starts, const at::Tensor& prompt_ids, const at::Tensor& output_starts,
    const at::Tensor& output_ids, const at::Tensor& suppressed_starts, const at::Tensor& suppressed_ids);
// Each row's log-sum-exp and its k best logits as log-probabilities, with their ids (logprobs.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits,
                                                                          const at::Tensor& targets,
                                                                          int64_t k);

// A linear layer's weights in int8_linear's packed format.
struct Int8Weight {
  at::Tensor packed, scales;
  c10::optional<at::Tensor> bias;
  // n: output rows as packed (a multiple of 16); out_features: the output's width, <= n (n / 2 where the rows are
  // a gated MLP's gate and up, interleaved, and the output is SiLU(gate) * up).
  int64_t n = 0, out_features = 0, bits = 8;
  bool silu_and_mul = false;

  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor y = int8_linear(x, packed, scales, bias, n, bits, silu_and_mul);
    return out_features == y.size(1) ? y : y.narrow(1, 0, out_features);
  }
};

// A decoder layer's linear, for decode_layer: int8_linear's packed weights, or a weight that oneDNN reordered into its
// blocked layout (PackedLinear, layers/linear.py), multiplied by the operator PackedLinear calls.
struct LayerLinear {
  c10::optional<Int8Weight> int8;
  c10::optional<at::Tensor> onednn_weight, onednn_bias;

  // Whether the output is already SiLU(gate) * up (an int8 gate_up packed for it).
  bool silu_and_mul() const { return int8.has_value() && int8->silu_and_mul; }
  at::Tensor operator()(const at::Tensor& x) const;
};

// One Qwen2/Qwen3 decoder layer whose linears are int8 or oneDNN-packed, for decode_layer.
struct DecodeLayerWeights {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3
  LayerLinear qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, scale = 1.0;
};

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const DecodeLayerWeights& layer,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens);
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const std::vector<DecodeLayerWeights>& layers, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& lens);

// The CPU allocator that caches large freed buffers (host_allocator.cpp): installed for the whole process.
void install_step_buffer_allocator(int64_t cache_limit_bytes);
void empty_step_buffer_cache();
std::tuple<int64_t, int64_t> step_buffer_stats();  // (bytes of our buffers in use, bytes cached)
