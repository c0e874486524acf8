// Fused CPU ops for small steps, where PyTorch's per-op cost (5-25 us an op on a [1, 896] tensor) rather
// than arithmetic sets the time: RMSNorm, SiLU(gate) * up, RoPE, and the greedy sampler's argmax (decode
// attention is in decode_attention.cpp). Arithmetic in float32 whatever the storage dtype; loops are written for
// the compiler to vectorize (the reductions through `omp simd`, which lets it reorder their sums), but for bf16
// rows of RMSNorm and SiLU * up on AVX-512 BF16, written in intrinsics (QB_BF16_VECTORS).
#include "bf16_vectors.h"
#include "float_math.h"
#include "ops.h"
#include "row_search.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define QB_BF16_VECTORS 1
#endif

namespace {

using qb::from_f32;
using qb::to_f32;
using qb::vec_exp;

#ifdef QB_BF16_VECTORS
// bf16 rows in AVX-512 BF16 intrinsics where the loops GCC vectorizes are bound by their instruction count: each
// rounding to bf16 there is ~6 integer instructions, here one vcvtneps2bf16 (to nearest even, as from_f32, but a
// float32 below 2^-126 becomes zero, ~1e-38 away).
using qb::bf16x16_to_f32;
using qb::f32_to_bf16x16;
using qb::load_bf16x16;
using qb::store_bf16x16;

// One row of rms_norm_impl for bf16 rows of a multiple of 16 values, the same steps and roundings (the sum of
// squares in another order). The generic loops took 1.0 cycle a value (1.4 with the residual add) from cache.
void rms_norm_row_bf16(const c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, c10::BFloat16* y,
                       int64_t n, float eps, float* buf) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load_bf16x16(x + i);
    if (residual != nullptr) {
      const __m256i sum = f32_to_bf16x16(_mm512_add_ps(v, load_bf16x16(residual + i)));
      store_bf16x16(residual + i, sum);
      v = bf16x16_to_f32(sum);
    }
    _mm512_storeu_ps(buf + i, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 normalized = bf16x16_to_f32(f32_to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv)));
    store_bf16x16(y + i, f32_to_bf16x16(_mm512_mul_ps(load_bf16x16(w + i), normalized)));
  }
}
#endif

// y = RMSNorm(x) * w, row by row. Where `residual` is given, x is first added into it in place (the sum rounded to
// T, as x + residual gives it) and the sum is what is normalized: the layer's residual add and its next norm in one
// pass over the rows.
template <typename T>
void rms_norm_impl(const T* x, T* residual, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
#ifdef QB_BF16_VECTORS
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (n % 16 == 0) {
          rms_norm_row_bf16(xr, residual == nullptr ? nullptr : residual + r * n, w, y + r * n, n, eps, buf.data());
          continue;
        }
      }
#endif
      if (residual != nullptr) {
        T* rr = residual + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          // the rounded sum twice, not a T kept in a variable: GCC does not vectorize a loop that copies one
          const float sum = to_f32(xr[i]) + to_f32(rr[i]);
          rr[i] = from_f32<T>(sum);
          buf[i] = to_f32(from_f32<T>(sum));
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(xr[i]);
      }
      // One loop for both, so that a sum normalizes to the same bits whether it was added here or before.
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* yr = y + r * n;
      // As the reference: normalise in float32, round to the storage dtype, then scale in it.
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = from_f32<T>(to_f32(w[i]) * to_f32(from_f32<T>(buf[i] * inv)));
    }
  });
}

#ifdef QB_BF16_VECTORS
// SiLU(gate) * up of a bf16 row, 16 lanes at a time, as qb::silu_times computes it but for two instructions:
// vscalefps applies exp's 2^n (no upper clamp, no exponent bits built by hand) and vcvtneps2bf16 rounds to bf16.
// The loop GCC vectorized from silu_times took 1.3 cycles an output, bound by its ~37 vector instructions per 16
// (its clamps as compares and blends, the roundings in integer arithmetic); this one is 1.26-1.31x faster at 2,048
// rows of the default model's gate_up (AMX kind).

// exp(x) by qb::vec_exp's polynomial, x clamped below at -87 as there; above, vscalefps goes to inf by itself.
inline __m512 exp_x16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  for (const float c : {1.3398874e-3f, 9.6180428e-3f, 5.5504108e-2f, 2.4022652e-1f, 6.9314718e-1f, 1.f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

void silu_and_mul_row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load_bf16x16(gate + i);
    const __m512 u = load_bf16x16(up + i);
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp_x16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m512 silu = bf16x16_to_f32(f32_to_bf16x16(_mm512_div_ps(g, d)));
    store_bf16x16(y + i, f32_to_bf16x16(_mm512_mul_ps(silu, u)));
  }
  for (; i < n; ++i) y[i] = qb::silu_times<c10::BFloat16>(to_f32(gate[i]), to_f32(up[i]));
}
#endif

template <typename T>
void silu_and_mul_impl(const T* x, T* y, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* yr = y + r * n;
#ifdef QB_BF16_VECTORS
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        silu_and_mul_row_bf16(gate, up, yr, n);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = qb::silu_times<T>(to_f32(gate[i]), to_f32(up[i]));
    }
  });
}

// One output of RoPE: round(round(x * cos) + round(rotated * sin)), each product rounded to T as the PyTorch
// expression rounds it.
template <typename T>
__attribute__((always_inline)) inline T rotate_one(T x, float rotated, T cos, T sin) {
  const float a = to_f32(from_f32<T>(to_f32(x) * to_f32(cos)));
  const float b = to_f32(from_f32<T>(rotated * to_f32(sin)));
  return from_f32<T>(a + b);
}

// Neox-layout RoPE: out = x * cos + rotate_half(x) * sin, each product rounded to the storage dtype first,
// as the PyTorch expression does. x: rows of `heads` vectors of head_dim (row stride ld), cos/sin [T, head_dim].
template <typename T>
void rotary_impl(const T* x, int64_t ld, int64_t head_stride, const T* cos, const T* sin, T* out, int64_t tokens,
                 int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * ld + h * head_stride;
        T* oh = out + (t * heads + h) * head_dim;
        // The two halves apart, so that each loop vectorizes; the rotated half is a T already (negation is exact).
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) oh[i] = rotate_one<T>(xh[i], -to_f32(xh[i + half]), c[i], s[i]);
#pragma omp simd
        for (int64_t i = half; i < head_dim; ++i) oh[i] = rotate_one<T>(xh[i], to_f32(xh[i - half]), c[i], s[i]);
      }
    }
  });
}

// Each row's first maximal logit and whether the row holds an inf or a NaN, in one read of the logits as they
// are: the sampler's float32 copy and argmax cost ~25 ms a step at 64 rows (a fresh 39 MB buffer, page faults).
// The maximum first, then the first index holding it (qb::first_index_of).
template <typename T>
void greedy_tokens_impl(const T* logits, int64_t rows, int64_t vocab, int64_t* tokens, bool* non_finite) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      float best = -std::numeric_limits<float>::infinity();
      float poison = 0.f;  // v * 0 is 0 for a finite v, NaN for an inf or a NaN
#pragma omp simd reduction(max : best) reduction(+ : poison)
      for (int64_t i = 0; i < vocab; ++i) {
        const float v = to_f32(row[i]);
        best = qb::max_of(best, v);
        poison += v * 0.f;
      }
      tokens[r] = qb::first_index_of(row, vocab, best);  // a row of NaNs fails its request: any id will do
      non_finite[r] = std::isnan(poison);
    }
  });
}

// Each row's logits where its allowed-token bits are set (bit j of word k: token 32k + j), -inf elsewhere, and
// whether the row's own logits hold an inf or a NaN. A structured output's mask, one read and one write of the
// row: by table and addition in PyTorch it took ~16 ms a step at 64 rows of 151,936 bf16 logits. Most words of a
// JSON mask are all clear (a few tokens allowed) or, inside a string, all set: each is a fill or a copy.
template <typename T>
void mask_to_allowed_impl(const T* logits, const uint32_t* bits, int64_t rows, int64_t vocab, int64_t words, T* out,
                          bool* non_finite) {
  const T blocked = T(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = logits + r * vocab;
      T* o = out + r * vocab;
      const uint32_t* row_bits = bits + r * words;
      float poison = 0.f;  // v * 0 is 0 for a finite v, NaN for an inf or a NaN
#pragma omp simd reduction(+ : poison)
      for (int64_t i = 0; i < vocab; ++i) poison += to_f32(in[i]) * 0.f;
      non_finite[r] = std::isnan(poison);
      for (int64_t k = 0; k * 32 < vocab; ++k) {
        const uint32_t word = row_bits[k];
        const int64_t base = k * 32, n = std::min<int64_t>(32, vocab - base);
        if (word == 0) {
          std::fill(o + base, o + base + n, blocked);
        } else if (word == ~0u) {
          std::copy(in + base, in + base + n, o + base);
        } else {
          for (int64_t j = 0; j < n; ++j) o[base + j] = (word >> j) & 1u ? in[base + j] : blocked;
        }
      }
    }
  });
}

}  // namespace

namespace {

// rms_norm and add_rms_norm: residual is null or a tensor the caller checked against x.
at::Tensor normalize(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps,
                     const char* name) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type(), name,
              ": weight must be [n] in x's dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  QB_DISPATCH(x.scalar_type(), name,
              rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                                      wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), xc.numel() / n, n,
                                      static_cast<float>(eps)));
  return y;
}

}  // namespace

// x: [..., n], weight: [n] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return normalize(x, nullptr, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual must be a contiguous tensor of x's shape and dtype");
  return normalize(x, &residual, weight, eps, "add_rms_norm");
}

// x: [T, heads, head_dim] with a contiguous last dim (e.g. a slice of the fused qkv output); cos, sin:
// [T, head_dim] (any leading view) in x's dtype. Returns a new contiguous [T, heads, head_dim].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, head_dim] with contiguous rows");
  const int64_t T = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const at::Tensor c = cos.reshape({T, head_dim}).contiguous(), s = sin.reshape({T, head_dim}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type() && head_dim % 2 == 0,
              "rotary: cos and sin in x's dtype, an even head_dim");
  at::Tensor out = at::empty({T, heads, head_dim}, x.options());
  QB_DISPATCH(x.scalar_type(), "rotary",
              rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                                    s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T, heads, head_dim));
  return out;
}

// x: [..., 2n] (gate, then up) -> [..., n].
at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t n = x.size(-1) / 2;
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  QB_DISPATCH(x.scalar_type(), "silu_and_mul",
              silu_and_mul_impl<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), xc.numel() / (2 * n), n));
  return y;
}

// logits: [B, vocab] float32, bfloat16 or float16. Returns (int64 [B]: each row's first maximal index, as
// argmax gives; bool [B]: the row holds an inf or a NaN).
std::tuple<at::Tensor, at::Tensor> greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_tokens: logits must be [B, vocab]");
  const at::Tensor lc = logits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  at::Tensor tokens = at::empty({rows}, lc.options().dtype(at::kLong));
  at::Tensor non_finite = at::empty({rows}, lc.options().dtype(at::kBool));
  QB_DISPATCH(lc.scalar_type(), "greedy_tokens",
              greedy_tokens_impl<scalar_t>(lc.data_ptr<scalar_t>(), rows, vocab, tokens.data_ptr<int64_t>(),
                                           non_finite.data_ptr<bool>()));
  return {tokens, non_finite};
}

// logits: [B, vocab] float32, bfloat16 or float16; bits: int32 [B, >= ceil(vocab / 32)]. Returns (a new [B, vocab]
// in the logits' dtype: -inf where a token's bit is clear; bool [B]: the row of logits holds an inf or a NaN).
std::tuple<at::Tensor, at::Tensor> mask_to_allowed(const at::Tensor& logits, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && bits.dim() == 2 && bits.size(0) == logits.size(0), "mask_to_allowed: [B, vocab]");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.size(1) * 32 >= logits.size(1),
              "mask_to_allowed: bits must be int32 [B, >= ceil(vocab / 32)]");
  const at::Tensor lc = logits.contiguous(), bc = bits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  at::Tensor out = at::empty_like(lc);
  at::Tensor non_finite = at::empty({rows}, lc.options().dtype(at::kBool));
  QB_DISPATCH(lc.scalar_type(), "mask_to_allowed",
              mask_to_allowed_impl<scalar_t>(lc.data_ptr<scalar_t>(), reinterpret_cast<const uint32_t*>(bc.data_ptr()),
                                             rows, vocab, bc.size(1), out.data_ptr<scalar_t>(),
                                             non_finite.data_ptr<bool>()));
  return {out, non_finite};
}
