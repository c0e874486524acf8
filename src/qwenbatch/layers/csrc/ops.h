// The CPU kernels module's functions, for bindings.cpp and for kernels that call the others.
#pragma once
// Not torch/extension.h: its pybind11 headers cost each source ~5 s more to build (a first start: 91 -> 40 s on
// 2 cores); only bindings.cpp includes it.
#include <torch/types.h>

#include <string>
#include <tuple>

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t N, int64_t bits, bool silu_and_mul);
std::string isa();
torch::Tensor int8_dequantize(const torch::Tensor& w, const torch::Tensor& scales, int64_t N, int64_t K, int64_t bits,
                              bool gate_up_halves);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> quantize_groups(const torch::Tensor& weight);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// residual += x in place (rounded to their dtype); returns RMSNorm(residual) * weight.
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& x);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& lens, double scale);
// The bf16 decode kernel's scores: "amx" (tiles), "avx512-bf16" (vdpbf16ps), or "float32" (only the float32 kernel).
std::string decode_attention_isa();
// What prefill_attention takes its two products with in `dtype` ("bfloat16" or "float32"): "amx" (tiles),
// "avx512-bf16" (vdpbf16ps), "avx2-fma", or "" where it was not built for that dtype.
std::string prefill_attention_isa(const std::string& dtype);
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                                const c10::optional<torch::Tensor>& slots, const c10::optional<torch::Tensor>& out);
std::tuple<torch::Tensor, torch::Tensor> greedy_tokens(const torch::Tensor& logits);
std::tuple<torch::Tensor, torch::Tensor> mask_to_allowed(const torch::Tensor& logits, const torch::Tensor& bits);
// Each row's token drawn at random after temperature, top-k, top-p and min-p, or its argmax, after its penalties and
// suppressed ids (sampling.cpp).
std::tuple<torch::Tensor, torch::Tensor> sample_tokens(
    const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
    const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& uniform,
    const torch::Tensor& repetition, const torch::Tensor& presence, const torch::Tensor& frequency,
    const torch::Tensor& prompt_starts, const torch::Tensor& prompt_ids, const torch::Tensor& output_starts,
    const torch::Tensor& output_ids, const torch::Tensor& suppressed_starts, const torch::Tensor& suppressed_ids);
// Each row's log-sum-exp and its k best logits as log-probabilities, with their ids (logprobs.cpp).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> token_logprobs(const torch::Tensor& logits,
                                                                                      const torch::Tensor& targets,
                                                                                      int64_t k);

// A linear layer's weights in int8_linear's packed format.
struct Int8Weight {
  torch::Tensor packed, scales;
  c10::optional<torch::Tensor> bias;
  // n: output rows as packed (a multiple of 16); out_features: the output's width, <= n (n / 2 where the rows are
  // a gated MLP's gate and up, interleaved, and the output is SiLU(gate) * up).
  int64_t n = 0, out_features = 0, bits = 8;
  bool silu_and_mul = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const torch::Tensor y = int8_linear(x, packed, scales, bias, n, bits, silu_and_mul);
    return out_features == y.size(1) ? y : y.narrow(1, 0, out_features);
  }
};

// A decoder layer's linear, for decode_layer: int8_linear's packed weights, or a weight that oneDNN reordered into its
// blocked layout (PackedLinear, layers/linear.py), multiplied by the operator PackedLinear calls.
struct LayerLinear {
  c10::optional<Int8Weight> int8;
  c10::optional<torch::Tensor> onednn_weight, onednn_bias;

  // Whether the output is already SiLU(gate) * up (an int8 gate_up packed for it).
  bool silu_and_mul() const { return int8.has_value() && int8->silu_and_mul; }
  torch::Tensor operator()(const torch::Tensor& x) const;
};

// One Qwen2/Qwen3 decoder layer whose linears are int8 or oneDNN-packed, for decode_layer.
struct DecodeLayerWeights {
  torch::Tensor input_norm, post_attention_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3
  LayerLinear qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, scale = 1.0;
};

std::tuple<torch::Tensor, torch::Tensor> decode_layer(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const DecodeLayerWeights& layer,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv_cache,
    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables, const torch::Tensor& lens);

// The CPU allocator that caches large freed buffers (host_allocator.cpp): installed for the whole process.
void install_step_buffer_allocator(int64_t cache_limit_bytes);
void empty_step_buffer_cache();
std::tuple<int64_t, int64_t> step_buffer_stats();  // (bytes of our buffers in use, bytes cached)
