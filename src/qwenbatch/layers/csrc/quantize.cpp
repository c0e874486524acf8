// Weight quantization for the int8 linear, in one pass over a float32 weight: per group of 32 inputs, GGUF's
// Q5_0 rule where it gives the group back exactly, else Q8_0's. The rules are layers/int8_linear.py's
// quantize_weight_q5 and quantize_weight (the reference, tested equal), done here because a model's worth of
// PyTorch element-wise passes takes ~10 s for 0.5B weights on two cores.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kGroup = 32;

// PyTorch's round (half to even), then the clamp; the divisor is never zero here.
inline int8_t round_clamped(float w, float d, float lo, float hi) {
  return static_cast<int8_t>(std::min(std::max(std::nearbyint(w / d), lo), hi));
}

bool all_exact(const float* w, const int8_t* v, float d) {
  for (int64_t i = 0; i < kGroup; ++i) {
    if (static_cast<float>(v[i]) * d != w[i]) return false;
  }
  return true;
}

// One group: Q5_0's scale is -(the first value of largest magnitude) / 16, Q8_0's is max |w| / 127, each
// rounded to float16 before the values are rounded to it. Returns (scale, whether Q5_0's rule was exact,
// whether the stored group is exact).
std::tuple<c10::Half, bool, bool> quantize_group(const float* w, int8_t* v) {
  int64_t extreme = 0;
  for (int64_t i = 1; i < kGroup; ++i) {
    if (std::fabs(w[i]) > std::fabs(w[extreme])) extreme = i;
  }
  const c10::Half q5_scale(-w[extreme] / 16.f);
  const float d5 = static_cast<float>(q5_scale);
  for (int64_t i = 0; i < kGroup; ++i) v[i] = d5 != 0.f ? round_clamped(w[i], d5, -16.f, 15.f) : 0;
  if (all_exact(w, v, d5)) return {q5_scale, true, true};
  const c10::Half q8_scale(std::fabs(w[extreme]) / 127.f);
  const float d8 = static_cast<float>(q8_scale);
  for (int64_t i = 0; i < kGroup; ++i) v[i] = d8 > 0.f ? round_clamped(w[i], d8, -127.f, 127.f) : 0;
  return {q8_scale, false, all_exact(w, v, d8)};
}

}  // namespace

// weight: float32 [N, K], K a multiple of 32. Returns (values int8 [N, K], scales float16 [N, K / 32],
// q5 bool [N, K / 32]: the group is a Q5_0 block (values in [-16, 15]), exact bool [N, K / 32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) % kGroup == 0,
              "quantize_groups: weight must be float32 [N, K] with K a multiple of 32");
  const at::Tensor w = weight.contiguous();
  const int64_t groups = w.numel() / kGroup;
  at::Tensor values = at::empty(w.sizes(), w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({w.size(0), w.size(1) / kGroup}, w.options().dtype(at::kHalf));
  at::Tensor q5 = at::empty(scales.sizes(), w.options().dtype(at::kBool));
  at::Tensor exact = at::empty(scales.sizes(), w.options().dtype(at::kBool));
  const float* src = w.data_ptr<float>();
  int8_t* dst = values.data_ptr<int8_t>();
  c10::Half* s = scales.data_ptr<c10::Half>();
  bool* is_q5 = q5.data_ptr<bool>();
  bool* is_exact = exact.data_ptr<bool>();
  at::parallel_for(0, groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      std::tie(s[g], is_q5[g], is_exact[g]) = quantize_group(src + g * kGroup, dst + g * kGroup);
    }
  });
  return {values, scales, q5, exact};
}
