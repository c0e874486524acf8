// Fused CPU ops for small steps, where PyTorch's per-op cost (5-25 us an op on a [1, 896] tensor) rather
// than arithmetic sets the time: RMSNorm, SiLU(gate) * up, RoPE, and decode attention reading the paged KV
// cache through the block tables in place (no per-step gather of each sequence's context).
// Arithmetic in float32 whatever the storage dtype; loops are written for the compiler to vectorize (the
// reductions through `omp simd`, which lets it reorder their sums).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp(x) in plain arithmetic the compiler vectorizes (std::exp stays a scalar call, ~10 ns an element):
// 2^(x log2 e) split into 2^n (built in the exponent bits) and 2^f, f in [-0.5, 0.5], by a degree-6
// polynomial; relative error below 3e-7. Inputs are clamped to [-87, 88], where 2^n stays a normal float.
#pragma omp declare simd
inline float vec_exp(float x) {
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

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        buf[i] = static_cast<float>(xr[i]);
        ss += buf[i] * buf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* yr = y + r * n;
      // As the reference: normalise in float32, round to the storage dtype, then scale in it.
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(buf[i] * inv)));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const T* x, T* y, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* yr = y + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = to_f32(gate[i]);
        // SiLU rounded to the storage dtype first, as F.silu(gate) * up does.
        const float s = to_f32(from_f32<T>(g / (1.f + vec_exp(-g))));
        yr[i] = from_f32<T>(s * to_f32(up[i]));
      }
    }
  });
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
        for (int64_t i = 0; i < head_dim; ++i) {
          const float rotated = i < half ? -static_cast<float>(xh[i + half]) : static_cast<float>(xh[i - half]);
          const T a = static_cast<T>(static_cast<float>(xh[i]) * static_cast<float>(c[i]));
          const T b = static_cast<T>(static_cast<float>(static_cast<T>(rotated)) * static_cast<float>(s[i]));
          oh[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    }
  });
}

// One (sequence, KV head) a task: its `group` query heads against the sequence's context, two passes (scores,
// then softmax-weighted values). The query heads are the vector lanes, kGroupLanes at a time (padded with zero
// heads), so neither product needs a horizontal sum: scores[p][g] += K[p][i] * Q[g][i] runs kPositions
// positions side by side (independent FMA chains), and out[g][i] += P[p][g] * V[p][i] keeps a
// kGroupLanes x 16 block of the output in registers across the context. K and V are converted to float32 once.
template <typename T>
void decode_attention_impl(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, const int32_t* lens,
                           T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int64_t kGroupLanes = 8, kPositions = 8, kDims = 16;
  const int64_t group = heads / kv_heads;
  const int64_t lanes = (group + kGroupLanes - 1) / kGroupLanes * kGroupLanes;  // padded query heads
  const int64_t token_stride = kv_heads * head_dim;  // between positions of one block
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt(head_dim * lanes), kf, vf, scores, acc(lanes * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens[s], padded = (len + kPositions - 1) / kPositions * kPositions;
      const int32_t* table = tables + s * max_blocks;
      std::fill(qt.begin(), qt.end(), 0.f);  // [lane chunk][dim][lane]
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          qt[((g / kGroupLanes) * head_dim + i) * kGroupLanes + g % kGroupLanes] =
              to_f32(q[(s * heads + h * group + g) * head_dim + i]) * scale;
      kf.assign(padded * head_dim, 0.f);  // positions past the context score 0 and are never used
      vf.resize(len * head_dim);
      for (int64_t p = 0; p < len; ++p) {
        if (p % block_size == 0 && p + block_size < len) {
          // The blocks are scattered, so the hardware prefetchers lose the stream at each one: ask for the
          // next block's K and V rows of this head while this block converts.
          const int64_t next = table[p / block_size + 1] * block_stride + h * head_dim;
          for (int64_t i = 0; i < block_size; ++i)
            for (int64_t b = 0; b < head_dim * static_cast<int64_t>(sizeof(T)); b += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next + i * token_stride) + b);
              __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next + i * token_stride) + b);
            }
        }
        const int64_t at = table[p / block_size] * block_stride + (p % block_size) * token_stride + h * head_dim;
        const T* kp = k_cache + at;
        const T* vp = v_cache + at;
        float* kf_p = kf.data() + p * head_dim;
        float* vf_p = vf.data() + p * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) kf_p[i] = to_f32(kp[i]);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) vf_p[i] = to_f32(vp[i]);
      }
      scores.resize(padded * lanes);  // [position][lane]
      for (int64_t c = 0; c < lanes; c += kGroupLanes) {
        const float* qc = qt.data() + c * head_dim;
        for (int64_t p0 = 0; p0 < padded; p0 += kPositions) {
          float dots[kPositions][kGroupLanes] = {};
          for (int64_t i = 0; i < head_dim; ++i) {
            const float* qi = qc + i * kGroupLanes;
            for (int64_t pp = 0; pp < kPositions; ++pp) {
              const float k = kf[(p0 + pp) * head_dim + i];
#pragma omp simd
              for (int64_t l = 0; l < kGroupLanes; ++l) dots[pp][l] += k * qi[l];
            }
          }
          for (int64_t pp = 0; pp < kPositions; ++pp)
            std::memcpy(scores.data() + (p0 + pp) * lanes + c, dots[pp], sizeof(dots[pp]));
        }
      }
      for (int64_t c = 0; c < lanes; c += kGroupLanes) {
        float mx[kGroupLanes], sum[kGroupLanes] = {};
        std::fill(mx, mx + kGroupLanes, -std::numeric_limits<float>::infinity());
        for (int64_t p = 0; p < len; ++p) {
          const float* sp = scores.data() + p * lanes + c;
#pragma omp simd
          for (int64_t l = 0; l < kGroupLanes; ++l) mx[l] = std::max(mx[l], sp[l]);
        }
        for (int64_t p = 0; p < len; ++p) {
          float* sp = scores.data() + p * lanes + c;
#pragma omp simd
          for (int64_t l = 0; l < kGroupLanes; ++l) {
            sp[l] = vec_exp(sp[l] - mx[l]);
            sum[l] += sp[l];
          }
        }
        float inv[kGroupLanes];
        for (int64_t l = 0; l < kGroupLanes; ++l) inv[l] = 1.f / sum[l];
        for (int64_t d0 = 0; d0 < head_dim; d0 += kDims) {
          float o[kGroupLanes][kDims] = {};
          for (int64_t p = 0; p < len; ++p) {
            const float* sp = scores.data() + p * lanes + c;
            const float* vd = vf.data() + p * head_dim + d0;
            for (int64_t l = 0; l < kGroupLanes; ++l) {
              const float w = sp[l];
#pragma omp simd
              for (int64_t i = 0; i < kDims; ++i) o[l][i] += w * vd[i];
            }
          }
          for (int64_t l = 0; l < kGroupLanes; ++l)
            for (int64_t i = 0; i < kDims; ++i) acc[(c + l) * head_dim + d0 + i] = o[l][i] * inv[l];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          out[(s * heads + h * group + g) * head_dim + i] = from_f32<T>(acc[g * head_dim + i]);
    }
  });
}

// Each row's first maximal logit and whether the row holds an inf or a NaN, in one read of the logits as they
// are: the sampler's float32 copy and argmax cost ~25 ms a step at 64 rows (a fresh 39 MB buffer, page faults).
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
        best = std::max(best, v);
        poison += v * 0.f;
      }
      int64_t at = 0;
      while (at < vocab && to_f32(row[at]) != best) ++at;
      tokens[r] = at < vocab ? at : 0;  // a row of NaNs fails its request; any id will do
      non_finite[r] = std::isnan(poison);
    }
  });
}

#define QB_DISPATCH(TYPE, NAME, ...)                                                      \
  switch (TYPE) {                                                                         \
    case torch::kFloat32: { using scalar_t = float; __VA_ARGS__; break; }                 \
    case torch::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }        \
    case torch::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }                \
    default: TORCH_CHECK(false, NAME ": float32, bfloat16 or float16 only");              \
  }

}  // namespace

// x: [..., n], weight: [n] in x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [n] in x's dtype");
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  QB_DISPATCH(x.scalar_type(), "rms_norm",
              rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                      xc.numel() / n, n, static_cast<float>(eps)));
  return y;
}

// x: [T, heads, head_dim] with a contiguous last dim (e.g. a slice of the fused qkv output); cos, sin:
// [T, head_dim] (any leading view) in x's dtype. Returns a new contiguous [T, heads, head_dim].
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, head_dim] with contiguous rows");
  const int64_t T = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const torch::Tensor c = cos.reshape({T, head_dim}).contiguous(), s = sin.reshape({T, head_dim}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type() && head_dim % 2 == 0,
              "rotary: cos and sin in x's dtype, an even head_dim");
  torch::Tensor out = torch::empty({T, heads, head_dim}, x.options());
  QB_DISPATCH(x.scalar_type(), "rotary",
              rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                                    s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T, heads, head_dim));
  return out;
}

// x: [..., 2n] (gate, then up) -> [..., n].
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  const int64_t n = x.size(-1) / 2;
  const torch::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor y = torch::empty(shape, x.options());
  QB_DISPATCH(x.scalar_type(), "silu_and_mul",
              silu_and_mul_impl<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), xc.numel() / (2 * n), n));
  return y;
}

// q: [D, heads, head_dim]; kv_cache: [2, blocks, block_size, kv_heads, head_dim]; block_tables: int32 [D, max_blocks];
// lens: int32 [D] (context lengths, the new token's K/V already stored). Returns [D, heads, head_dim].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && lens.dim() == 1,
              "paged_decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && kv_cache.is_contiguous(),
              "paged_decode_attention: q and a contiguous cache of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: int32 block tables and lengths");
  const int64_t D = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(head_dim % 16 == 0 && kv_cache.size(4) == head_dim && heads % kv_heads == 0,
              "paged_decode_attention: head shapes do not fit");
  const torch::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lc = lens.contiguous();
  torch::Tensor out = torch::empty_like(qc);
  const int64_t half = kv_cache.numel() / 2;
  QB_DISPATCH(q.scalar_type(), "paged_decode_attention",
              decode_attention_impl<scalar_t>(qc.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                                              kv_cache.data_ptr<scalar_t>() + half, tables.data_ptr<int32_t>(),
                                              lc.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), D, heads, kv_heads,
                                              head_dim, block_size, tables.size(1), static_cast<float>(scale)));
  return out;
}

// logits: [B, vocab] float32, bfloat16 or float16. Returns (int64 [B]: each row's first maximal index, as
// argmax gives; bool [B]: the row holds an inf or a NaN).
std::tuple<torch::Tensor, torch::Tensor> greedy_tokens(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_tokens: logits must be [B, vocab]");
  const torch::Tensor lc = logits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  torch::Tensor tokens = torch::empty({rows}, lc.options().dtype(torch::kInt64));
  torch::Tensor non_finite = torch::empty({rows}, lc.options().dtype(torch::kBool));
  QB_DISPATCH(lc.scalar_type(), "greedy_tokens",
              greedy_tokens_impl<scalar_t>(lc.data_ptr<scalar_t>(), rows, vocab, tokens.data_ptr<int64_t>(),
                                           non_finite.data_ptr<bool>()));
  return {tokens, non_finite};
}
