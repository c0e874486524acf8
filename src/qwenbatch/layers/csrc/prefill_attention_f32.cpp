// Prefill attention on the CPU in float32, for the float32 engines (the AVX2 kind's default dtype): a chunk's queries
// against its whole context, bottom-right causal, in prefill_attention.cpp's tiling (a block of queries of one head
// against a block of keys at a time, the softmax taken online), both products in 6 x 16 register tiles of AVX2 FMAs.
//
// Why our own: SDPA's CPU flash kernel runs each block product as an MKL sgemm call that packs both operands first,
// and its softmax in separate passes over the scores: 91 GFLOP/s at 4,096 tokens (GQA 14/2, head_dim 64, Zen 3, 2
// cores) against ~120 for a 2,048^3 float32 matmul, and a third of a 4,096-token int8 prefill (perf). Here K is
// packed once a call, the scores stay in L1/L2 between the products, and the softmax is one pass.
#include "index_math.h"
#include "prefill_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QB_PREFILL_F32 1
#endif

namespace qb {

bool prefill_attention_f32_built() {
#ifdef QB_PREFILL_F32
  return true;
#else
  return false;
#endif
}

#ifdef QB_PREFILL_F32
namespace {

// A task is kQueryRows queries of one head, walking its context kKeys keys at a time (as the bf16 kernel, whose
// measurements chose these); a register tile is kTileRows queries x 16 keys (scores) or x 16 dimensions (output):
// 12 accumulators, two loads and six broadcasts a step, BLIS's float32 tile shape for AVX2.
constexpr int64_t kQueryRows = 48, kKeys = 256, kTileRows = 6;
static_assert(kQueryRows % kTileRows == 0, "a task's rows are whole tiles");

// K of every KV head as [kv head][key / 8][dim][key % 8] (a score tile's two vectors a dimension), V as
// [kv head][dim / 16][key][dim % 16] (an output tile's strip of every key in a row: V read with a stride of a whole
// head_dim stalled the output tiles on their loads, 10% of a 2,048 x 8,192 call); zero past the context (keys padded
// to a whole block).
void pack_kv(const PrefillProblem<float>& pr, int64_t padded, float* k_packed, float* v_packed) {
  const int64_t d = pr.head_dim, panels = padded / 8;
  at::parallel_for(0, pr.kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / panels, key0 = task % panels * 8;
      float* kp = k_packed + (h * panels + key0 / 8) * d * 8;
      float* vp = v_packed + h * padded * d + key0 * 16;  // this panel's keys in the first strip
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t key = key0 + t;
        if (key >= pr.k_len) {
          for (int64_t j = 0; j < d; ++j) kp[j * 8 + t] = 0.f;
          for (int64_t i = 0; i < d; i += 16) std::fill_n(vp + i * padded + t * 16, 16, 0.f);
          continue;
        }
        const float* k_row = pr.k + pr.row_of(key) * pr.k_row + h * pr.k_head;
        for (int64_t j = 0; j < d; ++j) kp[j * 8 + t] = k_row[j];
        const float* v_row = pr.v + pr.row_of(key) * pr.v_row + h * pr.v_head;
        for (int64_t i = 0; i < d; i += 16) std::memcpy(vp + i * padded + t * 16, v_row + i, 16 * sizeof(float));
      }
    }
  });
}

using Tile = __m256[kTileRows][2];  // kTileRows rows of 16 floats

inline void store_tile(const Tile& acc, float* rows, int64_t stride) {
  for (int64_t r = 0; r < kTileRows; ++r) {
    _mm256_storeu_ps(rows + r * stride, acc[r][0]);
    _mm256_storeu_ps(rows + r * stride + 8, acc[r][1]);
  }
}

// scores[r][0..16) = q_r . k for kTileRows queries and 16 keys: q [dim][kQueryRows] from the tile's first query; k
// two panels of 8 keys, [dim][8] each, the second d * 8 floats after the first. Rows kKeys apart.
inline void score_tile(const float* q, int64_t d, const float* k, float* scores) {
  Tile acc;
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
  const float* k1 = k + d * 8;
  for (int64_t j = 0; j < d; ++j) {
    const __m256 k0v = _mm256_loadu_ps(k + j * 8), k1v = _mm256_loadu_ps(k1 + j * 8);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const __m256 qr = _mm256_broadcast_ss(q + j * kQueryRows + r);
      acc[r][0] = _mm256_fmadd_ps(qr, k0v, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qr, k1v, acc[r][1]);
    }
  }
  store_tile(acc, scores, kKeys);
}

// out[r][0..16) += sum over `live` keys of p_r[key] * v[key][0..16), for kTileRows queries: p rows kKeys apart, v
// one strip's rows of 16, out rows d apart.
inline void output_tile(const float* p, int64_t live, const float* v, int64_t d, float* out) {
  Tile acc;
  for (int64_t r = 0; r < kTileRows; ++r) {
    acc[r][0] = _mm256_loadu_ps(out + r * d);
    acc[r][1] = _mm256_loadu_ps(out + r * d + 8);
  }
  for (int64_t key = 0; key < live; ++key) {
    const __m256 v0 = _mm256_loadu_ps(v + key * 16), v1 = _mm256_loadu_ps(v + key * 16 + 8);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kKeys + key);
      acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  store_tile(acc, out, d);
}

// 2^t on 8 lanes for t <= 0: 2^n built in the exponent bits and 2^f, f in [-0.5, 0.5], by float_math.h's degree-6
// polynomial (relative error below 3e-7). t is clamped at -126, where 2^n stays a normal float; a weight that small
// is zero to the sums it joins.
inline __m256 exp2_8(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180428e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
}

// Lanes [0, n) set, for n >= 0.
inline __m256 first_lanes(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i count = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lane));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The online softmax of one query's block of scores, in log2 units (the queries were scaled by scale * log2 e):
// `live` of them, a multiple of 16, the first `visible` real, the rest masked or padding. Writes the weights
// 2^(s - max) to `p` (0 where not visible), moves the running max and sum on, and returns the factor the output so
// far must be multiplied by.
inline float softmax_row(const float* s, int64_t live, int64_t visible, float& mx, float& sum, float* p) {
  if (visible <= 0) {
    std::memset(p, 0, live * sizeof(float));
    return 1.f;
  }
  const int64_t seen = std::min(live, round_up(visible, 8));  // the vectors holding a visible score
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < seen; c += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, _mm256_loadu_ps(s + c), first_lanes(visible - c)));
  const float new_max = std::max(mx, horizontal_max(vmax));
  const __m256 vnew_max = _mm256_set1_ps(new_max);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t c = 0; c < seen; c += 8) {
    const __m256 w = _mm256_and_ps(exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + c), vnew_max)), first_lanes(visible - c));
    vsum = _mm256_add_ps(vsum, w);
    _mm256_storeu_ps(p + c, w);
  }
  std::memset(p + seen, 0, (live - seen) * sizeof(float));
  const float shrink = mx == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(mx - new_max);
  sum = sum * shrink + horizontal_sum(vsum);
  mx = new_max;
  return shrink;
}

}  // namespace

void prefill_attention_f32(const PrefillProblem<float>& pr) {
  const int64_t d = pr.head_dim, group = pr.heads / pr.kv_heads;
  const int64_t padded = round_up(pr.k_len, kKeys), offset = pr.k_len - pr.q_len;
  // Not zero-filled: pack_kv writes every element.
  const std::unique_ptr<float[]> k_packed(new float[pr.kv_heads * padded * d]),
      v_packed(new float[pr.kv_heads * padded * d]);
  pack_kv(pr, padded, k_packed.get(), v_packed.get());
  const int64_t query_blocks = ceil_div(pr.q_len, kQueryRows);
  const float q_factor = pr.scale * 1.44269504088896341f;  // scores in log2 units: the softmax takes 2^x
  // Head-major, as the bf16 kernel: with as many threads as divide the heads, causal blocks fall to all alike.
  at::parallel_for(0, pr.heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(kQueryRows * d), scores(kQueryRows * kKeys), p(kQueryRows * kKeys), out(kQueryRows * d),
        mx(kQueryRows), sum(kQueryRows), shrink(kQueryRows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / query_blocks, q0 = task % query_blocks * kQueryRows;
      const int64_t rows = std::min(kQueryRows, pr.q_len - q0), kvh = h / group;
      const int64_t tile_rows = round_up(rows, kTileRows);  // rows past the chunk: zero queries, results dropped
      std::fill(q.begin(), q.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = pr.q + (q0 + r) * pr.q_row + h * pr.q_head;
        for (int64_t j = 0; j < d; ++j) q[j * kQueryRows + r] = src[j] * q_factor;
      }
      std::fill(out.begin(), out.end(), 0.f);
      std::fill(p.begin(), p.end(), 0.f);  // rows past the chunk keep zero weights
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const float* kh = k_packed.get() + kvh * padded * d;
      const float* vh = v_packed.get() + kvh * padded * d;
      const int64_t keys_seen = q0 + rows + offset;  // by the block's last query
      for (int64_t k0 = 0; k0 < keys_seen; k0 += kKeys) {
        // The block's keys that any of its queries sees, in whole score tiles: on the diagonal the rest are skipped.
        const int64_t live = std::min(kKeys, round_up(keys_seen - k0, 16));
        for (int64_t r = 0; r < tile_rows; r += kTileRows)
          for (int64_t kk = 0; kk < live; kk += 16)
            score_tile(q.data() + r, d, kh + (k0 + kk) * d, scores.data() + r * kKeys + kk);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min({kKeys, q0 + r + offset + 1 - k0, pr.k_len - k0});
          shrink[r] = softmax_row(scores.data() + r * kKeys, live, visible, mx[r], sum[r], p.data() + r * kKeys);
        }
        for (int64_t r = 0; r < rows; ++r) {
          if (shrink[r] == 1.f) continue;
          float* o = out.data() + r * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) o[i] *= shrink[r];
        }
        for (int64_t r = 0; r < tile_rows; r += kTileRows)
          for (int64_t i = 0; i < d; i += 16)
            output_tile(p.data() + r * kKeys, live, vh + i * padded + k0 * 16, d, out.data() + r * d + i);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / sum[r];
        float* dst = pr.out + ((q0 + r) * pr.heads + h) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = out[r * d + i] * inv;
      }
    }
  });
}

#else
void prefill_attention_f32(const PrefillProblem<float>&) {
  TORCH_CHECK(false, "prefill_attention: float32 was built without AVX2 and FMA");
}
#endif

}  // namespace qb
