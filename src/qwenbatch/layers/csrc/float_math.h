// Float32 arithmetic helpers shared by the CPU kernels: an exp the compiler vectorizes, storage <-> float32
// conversions it vectorizes, and the dtype switch of the kernels' entry points.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace qb {

// exp(x) in plain arithmetic the compiler vectorizes (std::exp stays a scalar call, ~10 ns an element):
// 2^(x log2 e) split into 2^n (built in the exponent bits) and 2^f, f in [-0.5, 0.5], by a degree-6
// polynomial; relative error below 3e-7. Inputs are clamped to [-87, 88], where 2^n stays a normal float.
// Forced inline, as silu_times below: out of line, a loop calling them is left scalar (GCC took both out of
// int8_linear.cpp's SiLU stores when an unrelated template was added, and the fused gate_up ran 0.56x).
#pragma omp declare simd
__attribute__((always_inline)) inline float vec_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180428e-3f;
  p = p * f + 5.5504108e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// The larger of a and b, for max-reductions in `omp simd` loops: GCC 12 reports such a loop vectorized with std::max
// but emits only its scalar version (vmaxss), and a loop computing more beside the maximum stays scalar with it
// (the sampling kernel's first pass, a vdivss a logit: ~230 us a row of 151,936). b where either is a NaN.
__attribute__((always_inline)) inline float max_of(float a, float b) { return a > b ? a : b; }

// The sum of f(i) over i in [0, n): float32 within blocks of 256 in 16 lanes (element i in lane i % 16), each
// block's lanes added into lanes of double, summed once at the end with the last, partial block's float32 sum. An `omp simd` sum over each block sums the
// block's lanes one after another through memory (GCC 12): a fifth of an exp-and-sum pass over a row of logits, a
// third of a compare-and-sum pass (7.2 against 11.9 us over 151,936 floats from L2, AMX kind).
template <typename F>
__attribute__((always_inline)) inline double lane_sum(int64_t n, F f) {
  constexpr int64_t kLanes = 16, kBlock = 256;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float part[kLanes] = {};
    for (int64_t j = i; j < i + kBlock; j += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) part[l] += f(j + l);
    }
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += part[l];
  }
  float tail = 0.f;
#pragma omp simd reduction(+ : tail)
  for (int64_t j = i; j < n; ++j) tail += f(j);
  double total = tail;
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// Storage <-> float32 conversions the compiler vectorizes: c10::BFloat16's own are branchy scalar code
// (a silu_and_mul row of 4,864 took 40 us with them, 3 us in float32). Same rounding (to nearest even, NaN
// to 0x7FC0).
template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_f32(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <typename T>
inline T from_f32(float f) {
  return static_cast<T>(f);
}
template <>
inline c10::BFloat16 from_f32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// SiLU(gate) * up in T as F.silu(gate) * up computes it: the SiLU rounded to T before the product. gate and up
// are T values, widened.
template <typename T>
__attribute__((always_inline)) inline T silu_times(float gate, float up) {
  const float silu = to_f32(from_f32<T>(gate / (1.f + vec_exp(-gate))));
  return from_f32<T>(silu * up);
}

}  // namespace qb

#define QB_DISPATCH(TYPE, NAME, ...)                                                     \
  switch (TYPE) {                                                                        \
    case c10::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                    \
    case c10::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }         \
    case c10::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }                 \
    default: TORCH_CHECK(false, NAME, ": float32, bfloat16 or float16 only");            \
  }
