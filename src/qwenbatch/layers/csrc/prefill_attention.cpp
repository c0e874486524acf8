// Prefill attention on the CPU in bfloat16: a chunk's queries against its whole context (cached keys, then its own),
// bottom-right causal, FlashAttention's tiling (a block of queries against a block of keys at a time, the softmax
// taken online) with both products in register tiles of AVX512-BF16's pair dot products (vdpbf16ps), or, where the
// CPU has AMX and Linux grants this process its tiles, in AMX tiles on the same packed K and V. Built only where the
// CPU has AVX512-BF16; elsewhere bf16 engines keep SDPA's flash kernel. Float32 calls go to prefill_attention_f32.cpp.
//
// Why our own: SDPA's CPU flash kernel runs at 42-97 GFLOP/s on these shapes (GQA 14/2, head_dim 64, bf16) against
// ~420 for a bf16 matmul, and computes then masks the upper triangle of a chunk after a cached prefix. On the AMX
// kind it runs its block products in AMX tiles too (oneDNN), at 200-520 GFLOP/s; the vdpbf16ps kernel there made
// 0.3-0.6x that, the tiles 1.1-2.1x (600-720 GFLOP/s, prefill_attention_micro.py).
#include "amx.h"
#include "float_math.h"
#include "index_math.h"
#include "ops.h"
#include "prefill_attention.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QB_PREFILL_BF16 1
#endif

std::string prefill_attention_isa(const std::string& dtype) {
  if (dtype == "float32") return qb::prefill_attention_f32_built() ? "avx2-fma" : "";
  if (dtype != "bfloat16") return "";
#if defined(QB_PREFILL_BF16) && defined(QB_AMX)
  if (qb::amx_permitted()) return "amx";
#endif
#ifdef QB_PREFILL_BF16
  return "avx512-bf16";
#else
  return "";
#endif
}

#ifdef QB_PREFILL_BF16
namespace {

// A task is kQueryRows queries of one head; it walks its context kKeys keys at a time: the softmax's per-row
// reductions and the output's rescaling come once a block, so long blocks do them less often, while on the diagonal
// only the keys some query of the block sees are multiplied (whole 32-key score tiles). 256 keys against 128 without
// that trim: 1.05x at 2,048 x 8,192, 1.17x at 300 x 300, 1.05-1.21x everywhere (prefill_attention_micro.py --base,
// Zen 5). The score tile is kScoreRows queries x 32 keys (24 accumulators), the output tile kOutRows queries x 64
// dimensions (24).
constexpr int64_t kQueryRows = 48, kKeys = 256, kScoreRows = 12, kOutRows = 6;

using qb::round_up;

inline uint32_t word(const c10::BFloat16* p) {  // two adjacent bf16 values, a vdpbf16ps pair
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// scores[r][0..32) = q_r . k for kScoreRows queries and 32 keys. q: [dim pair][kQueryRows] words (one base pointer
// and constant offsets: a pointer per row would not fit the general registers); k: two panels of 16 keys, each
// [dim pair][key][2 dims], the second `panel` words after the first.
inline void score_tile(const uint32_t* q, int64_t dim_pairs, const uint32_t* k, int64_t panel, float* scores,
                       int64_t stride) {
  __m512 acc[kScoreRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < dim_pairs; ++j) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k + j * 16);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k + panel + j * 16);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[j * kQueryRows + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qr);
    }
  }
  for (int64_t r = 0; r < kScoreRows; ++r) {
    _mm512_storeu_ps(scores + r * stride, acc[r][0]);
    _mm512_storeu_ps(scores + r * stride + 16, acc[r][1]);
  }
}

// out[r][0..16 Z) += sum over key pairs of p_r's pair . v's pair, for kOutRows queries: p rows of `pairs` words
// (`p_stride` apart), v rows [key pair][dim][2 keys] `v_stride` words apart.
template <int Z>
inline void output_tile(const uint32_t* p, int64_t p_stride, int64_t pairs, const uint32_t* v, int64_t v_stride,
                        float* out, int64_t out_stride) {
  __m512 acc[kOutRows][Z];
  for (int64_t r = 0; r < kOutRows; ++r)
    for (int z = 0; z < Z; ++z) acc[r][z] = _mm512_loadu_ps(out + r * out_stride + z * 16);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh vz[Z];
    for (int z = 0; z < Z; ++z) vz[z] = (__m512bh)_mm512_loadu_si512(v + kp * v_stride + z * 16);
    for (int64_t r = 0; r < kOutRows; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * p_stride + kp]));
      for (int z = 0; z < Z; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], vz[z], w);
    }
  }
  for (int64_t r = 0; r < kOutRows; ++r)
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(out + r * out_stride + z * 16, acc[r][z]);
}

#ifdef QB_AMX
// The two products on AMX tiles where the process may use them (16 x 16 x 32 products): the packed K and V are already
// B tiles, the queries' rows and the weights' rows A tiles as they lie. One call is N column tiles of one 16-row
// block: C tiles 0..N-1, the A tile 4, B tiles 5-7 in turn, so each A load feeds N products and N accumulators keep
// the tile unit's busier (one accumulator a call ran 1.1-1.4x slower, prefill_attention_micro.py).
// c[16 rows][N x 16] (+)= sum over `chunks` of a's [16 rows][32 values] chunk times b's column tiles' chunk; a chunk
// is `a_step` bytes further along a's rows, `b_step` along b's, and column tile n is `b_col * n` bytes on.
template <int N, bool kAccumulate>
inline void tile_row(const char* a, int64_t a_stride, int64_t a_step, int64_t chunks, const char* b, int64_t b_stride,
                     int64_t b_step, int64_t b_col, float* c, int64_t c_stride) {
  static_assert(N == 1 || N == 2 || N == 4);
  char* cb = reinterpret_cast<char*>(c);
  if (kAccumulate) {
    _tile_loadd(0, cb, c_stride);
    if (N > 1) _tile_loadd(1, cb + 64, c_stride);
    if (N > 2) {
      _tile_loadd(2, cb + 128, c_stride);
      _tile_loadd(3, cb + 192, c_stride);
    }
  } else {
    _tile_zero(0);
    if (N > 1) _tile_zero(1);
    if (N > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t j = 0; j < chunks; ++j, a += a_step, b += b_step) {
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, b, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (N > 1) {
      _tile_loadd(6, b + b_col, b_stride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (N > 2) {
      _tile_loadd(7, b + 2 * b_col, b_stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 3 * b_col, b_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, cb, c_stride);
  if (N > 1) _tile_stored(1, cb + 64, c_stride);
  if (N > 2) {
    _tile_stored(2, cb + 128, c_stride);
    _tile_stored(3, cb + 192, c_stride);
  }
}

// `columns` column tiles of a row block, four, then two, then one at a time: call(n, width) for the first column
// tile n of each group, the group's width as a compile-time constant (tile_row's N).
template <typename Call>
inline void tile_columns(int64_t columns, const Call& call) {
  int64_t n = 0;
  for (; n + 4 <= columns; n += 4) call(n, std::integral_constant<int, 4>{});
  for (; n + 2 <= columns; n += 2) call(n, std::integral_constant<int, 2>{});
  for (; n < columns; ++n) call(n, std::integral_constant<int, 1>{});
}

// scores[r][0..live) = q_r . k for all kQueryRows queries: q_rows [kQueryRows][d] bf16, k packed as pack_kv's from
// the block's first key.
inline void scores_amx(const c10::BFloat16* q_rows, int64_t d, const uint32_t* k, int64_t live, float* scores) {
  const int64_t panel = d / 2 * 16 * 4;  // bytes of 16 keys' packed K
  for (int64_t r = 0; r < kQueryRows; r += 16)
    tile_columns(live / 16, [&](int64_t n, auto width) {
      tile_row<decltype(width)::value, false>(reinterpret_cast<const char*>(q_rows + r * d), d * 2, 64, d / 32,
                                              reinterpret_cast<const char*>(k) + n * panel, 64, 16 * 16 * 4, panel,
                                              scores + r * kKeys + n * 16, kKeys * 4);
    });
}

// out[r][0..d) += p_r . v over `live` keys for all kQueryRows queries: p rows of kKeys / 2 words, v packed as
// pack_kv's from the block's first key pair, out [kQueryRows][d].
inline void output_amx(const uint32_t* p, int64_t live, const uint32_t* v, int64_t d, float* out) {
  for (int64_t r = 0; r < kQueryRows; r += 16)
    tile_columns(d / 16, [&](int64_t n, auto width) {
      tile_row<decltype(width)::value, true>(reinterpret_cast<const char*>(p + r * (kKeys / 2)), kKeys * 2, 64,
                                             live / 32, reinterpret_cast<const char*>(v + n * 16), d * 4, 16 * d * 4,
                                             64, out + r * d + n * 16, d * 4);
    });
}
#endif

using Problem = qb::PrefillProblem<c10::BFloat16>;

// K and V of every KV head in the tiles' layouts, zero past the context (keys padded to a whole block):
// k: [kv head][key / 16][dim pair][key % 16] words; v: [kv head][key pair][dim] words.
void pack_kv(const Problem& pr, int64_t padded, uint32_t* k_packed, uint32_t* v_packed) {
  const int64_t dim_pairs = pr.head_dim / 2, d = pr.head_dim, panels = padded / 16;
  at::parallel_for(0, pr.kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / panels, key0 = task % panels * 16;
      uint32_t* kp = k_packed + (h * panels + key0 / 16) * dim_pairs * 16;
      uint32_t* vp = v_packed + (h * padded + key0) / 2 * d;
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t key = key0 + t;
        if (key >= pr.k_len) {
          for (int64_t j = 0; j < dim_pairs; ++j) kp[j * 16 + t] = 0u;
          continue;
        }
        const c10::BFloat16* row = pr.k + pr.row_of(key) * pr.k_row + h * pr.k_head;
        for (int64_t j = 0; j < dim_pairs; ++j) kp[j * 16 + t] = word(row + 2 * j);
      }
      // A V row's bits, or zeros past the context.
      const auto v_row = [&](int64_t key, int64_t i) -> uint32_t {
        return key < pr.k_len ? reinterpret_cast<const uint16_t*>(pr.v + pr.row_of(key) * pr.v_row + h * pr.v_head)[i]
                              : 0u;
      };
      for (int64_t t = 0; t < 16; t += 2) {
        uint32_t* dst = vp + t / 2 * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = v_row(key0 + t, i) | v_row(key0 + t + 1, i) << 16;
      }
    }
  });
}

// exp(x) on 16 lanes for x <= 0 (scores less their running maximum): 2^(x log2 e) split into 2^n, applied by
// vscalefps (0 once n is below float's range), and 2^f, f in [-0.5, 0.5], by a degree-4 least-squares polynomial
// (relative error 7e-6: the weights are rounded to bf16, 4e-3, for P.V anyway).
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6707631e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5875502e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022212e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312727e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of one query's block of scores (`live` of them, a multiple of 32: the first `visible` are
// real, the rest masked or padding): writes the weights exp(scale * s - max) as bf16 pairs in key order to `p` (0
// where not visible), moves the running max and sum on, and returns the factor the output so far must be
// multiplied by.
inline float softmax_row(const float* s, int64_t live, int64_t visible, float scale, float& mx, float& sum,
                         uint32_t* p) {
  if (visible <= 0) {
    std::memset(p, 0, live * 2);
    return 1.f;
  }
  constexpr int64_t kVectors = kKeys / 16;
  const int64_t vectors = live / 16;
  __mmask16 masks[kVectors];
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < vectors; ++c) {
    const int64_t lanes = std::clamp<int64_t>(visible - c * 16, 0, 16);
    masks[c] = static_cast<__mmask16>((1u << lanes) - 1u);
    vmax = _mm512_mask_max_ps(vmax, masks[c], vmax, _mm512_loadu_ps(s + c * 16));
  }
  const float new_max = std::max(mx, _mm512_reduce_max_ps(vmax) * scale);
  const __m512 vscale = _mm512_set1_ps(scale), vnew_max = _mm512_set1_ps(new_max);
  __m512 vsum = _mm512_setzero_ps(), weights[kVectors];
  for (int64_t c = 0; c < vectors; ++c) {
    weights[c] = _mm512_maskz_mov_ps(masks[c], exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + c * 16), vscale, vnew_max)));
    vsum = _mm512_add_ps(vsum, weights[c]);
  }
  for (int64_t c = 0; c < vectors; c += 2)  // rounded to nearest even
    _mm512_storeu_si512(p + c * 8, (__m512i)_mm512_cvtne2ps_pbh(weights[c + 1], weights[c]));
  const float shrink = mx == -std::numeric_limits<float>::infinity() ? 0.f : qb::vec_exp(mx - new_max);
  sum = sum * shrink + _mm512_reduce_add_ps(vsum);
  mx = new_max;
  return shrink;
}

void prefill_attention_bf16(const Problem& pr) {
  const int64_t d = pr.head_dim, dim_pairs = d / 2, group = pr.heads / pr.kv_heads;
  const int64_t padded = round_up(pr.k_len, kKeys), offset = pr.k_len - pr.q_len;
  // Not zero-filled: pack_kv writes every word.
  const std::unique_ptr<uint32_t[]> k_packed(new uint32_t[pr.kv_heads * padded * dim_pairs]),
      v_packed(new uint32_t[pr.kv_heads * padded / 2 * d]);
  pack_kv(pr, padded, k_packed.get(), v_packed.get());
  const int64_t query_blocks = (pr.q_len + kQueryRows - 1) / kQueryRows;
  // Head-major: with as many threads as divide the heads (2 here, 14 heads) each thread's range is whole heads, so
  // causal blocks of every size fall to every thread alike; otherwise the thread holding the most late blocks
  // bounds the call (~12% over the mean at 16 threads).
  at::parallel_for(0, pr.heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
#ifdef QB_AMX
    const bool amx = qb::amx_permitted();
    if (amx) qb::configure_tiles();
#else
    constexpr bool amx = false;
#endif
    // The queries as vdpbf16ps broadcasts them ([dim pair][query] words), or as AMX's A tiles ([query][dim]).
    std::vector<uint32_t> q(amx ? 0 : kQueryRows * dim_pairs), p(kQueryRows * kKeys / 2);
    std::vector<c10::BFloat16> q_rows(amx ? kQueryRows * d : 0);
    std::vector<float> scores(kQueryRows * kKeys), out(kQueryRows * d), mx(kQueryRows), sum(kQueryRows),
        shrink(kQueryRows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / query_blocks, q0 = task % query_blocks * kQueryRows;
      const int64_t rows = std::min(kQueryRows, pr.q_len - q0), kvh = h / group;
      // Rows past the chunk: zero queries, their results dropped.
      if (amx) {
        std::fill(q_rows.begin(), q_rows.end(), c10::BFloat16(0.f));
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(q_rows.data() + r * d, pr.q + (q0 + r) * pr.q_row + h * pr.q_head, d * 2);
      } else {
        std::fill(q.begin(), q.end(), 0u);
        for (int64_t r = 0; r < rows; ++r) {
          const c10::BFloat16* src = pr.q + (q0 + r) * pr.q_row + h * pr.q_head;
          for (int64_t j = 0; j < dim_pairs; ++j) q[j * kQueryRows + r] = word(src + 2 * j);
        }
      }
      std::fill(out.begin(), out.end(), 0.f);
      std::fill(p.begin(), p.end(), 0u);  // rows past the chunk keep zero weights
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const uint32_t* kh = k_packed.get() + kvh * padded * dim_pairs;
      const uint32_t* vh = v_packed.get() + kvh * padded / 2 * d;
      const int64_t keys_seen = q0 + rows + offset;  // by the block's last query
      for (int64_t k0 = 0; k0 < keys_seen; k0 += kKeys) {
        // The block's keys that any of its queries sees, in whole score tiles: on the diagonal the rest are skipped.
        const int64_t live = std::min(kKeys, round_up(keys_seen - k0, 32));
#ifdef QB_AMX
        if (amx) scores_amx(q_rows.data(), d, kh + k0 * dim_pairs, live, scores.data());
#endif
        if (!amx)
          for (int64_t r = 0; r < kQueryRows; r += kScoreRows)
            for (int64_t kk = 0; kk < live; kk += 32)
              score_tile(q.data() + r, dim_pairs, kh + (k0 + kk) * dim_pairs, 16 * dim_pairs,
                         scores.data() + r * kKeys + kk, kKeys);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min({kKeys, q0 + r + offset + 1 - k0, pr.k_len - k0});
          shrink[r] =
              softmax_row(scores.data() + r * kKeys, live, visible, pr.scale, mx[r], sum[r], p.data() + r * kKeys / 2);
        }
        for (int64_t r = 0; r < rows; ++r) {
          if (shrink[r] == 1.f) continue;
          float* o = out.data() + r * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) o[i] *= shrink[r];
        }
        const uint32_t* vb = vh + k0 / 2 * d;
#ifdef QB_AMX
        if (amx) {
          output_amx(p.data(), live, vb, d, out.data());
          continue;
        }
#endif
        for (int64_t r = 0; r < rows; r += kOutRows) {
          int64_t i = 0;
          for (; i + 64 <= d; i += 64)
            output_tile<4>(p.data() + r * kKeys / 2, kKeys / 2, live / 2, vb + i, d, out.data() + r * d + i, d);
          for (; i < d; i += 32)
            output_tile<2>(p.data() + r * kKeys / 2, kKeys / 2, live / 2, vb + i, d, out.data() + r * d + i, d);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / sum[r];
        c10::BFloat16* dst = pr.out + ((q0 + r) * pr.heads + h) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = qb::from_f32<c10::BFloat16>(out[r * d + i] * inv);
      }
    }
#ifdef QB_AMX
    if (amx) _tile_release();
#endif
  });
}

}  // namespace
#endif

namespace {

// The call's problem over tensors whose last dimension is contiguous (made so where not).
template <typename T>
qb::PrefillProblem<T> problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 at::Tensor& result, int64_t k_len, float scale, const int64_t* slots) {
  return {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), result.data_ptr<T>(), q.size(0), k_len, q.size(1),
          k.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale,
          slots};
}

}  // namespace

// q: [Lq, heads, d]; k, v: [Lk, kv_heads, d], Lk >= Lq, or with `slots` (int64 [Lk]) rows of a paged cache that
// slots pick in key order; all bfloat16 (d a multiple of 32) or all float32 (d a multiple of 16). Query i attends to
// keys 0 ..= i + Lk - Lq (the chunk's queries are the context's last ones). Writes into `out` ([Lq, heads, d],
// contiguous, q's dtype) where given; returns it.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             const c10::optional<at::Tensor>& slots, const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: [tokens, heads, head_dim] tensors");
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "prefill_attention: CPU tensors only");
  TORCH_CHECK(scale > 0, "prefill_attention: the scale must be positive (the bf16 kernel takes its running maximum unscaled)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "prefill_attention: bfloat16 or float32, the same for q, k and v");
  const bool f32 = dtype == at::kFloat;
  TORCH_CHECK(!prefill_attention_isa(f32 ? "float32" : "bfloat16").empty(),
              f32 ? "prefill_attention: float32 needs AVX2 and FMA" : "prefill_attention: bfloat16 needs AVX512-BF16");
  const int64_t q_len = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  const int64_t k_len = slots.has_value() ? slots->numel() : k.size(0);
  TORCH_CHECK(d > 0 && d % (f32 ? 16 : 32) == 0 && k.size(2) == d && v.sizes() == k.sizes() && kv_heads > 0 &&
                  heads % kv_heads == 0 && k_len >= q_len,
              "prefill_attention: shapes do not fit");
  at::Tensor slots_c;
  if (slots.has_value()) {
    slots_c = slots->contiguous();
    TORCH_CHECK(slots_c.scalar_type() == at::kLong && slots_c.dim() == 1, "prefill_attention: int64 [Lk] slots");
    const int64_t* slot_ids = slots_c.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(slot_ids, slot_ids + k_len, [&](int64_t slot) { return slot >= 0 && slot < k.size(0); }),
                "prefill_attention: a slot outside the cache");
  }
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous(), kc = k.stride(2) == 1 ? k : k.contiguous(),
                   vc = v.stride(2) == 1 ? v : v.contiguous();
  at::Tensor result = out.has_value() ? *out : at::empty({q_len, heads, d}, q.options());
  TORCH_CHECK(result.sizes() == q.sizes() && result.scalar_type() == dtype && result.is_contiguous(),
              "prefill_attention: out must be a contiguous tensor of q's shape and dtype");
  if (q_len == 0) return result;
  const int64_t* slot_rows = slots.has_value() ? slots_c.data_ptr<int64_t>() : nullptr;
  const float s = static_cast<float>(scale);
  if (f32) {
    qb::prefill_attention_f32(problem_of<float>(qc, kc, vc, result, k_len, s, slot_rows));
    return result;
  }
#ifdef QB_PREFILL_BF16
  prefill_attention_bf16(problem_of<c10::BFloat16>(qc, kc, vc, result, k_len, s, slot_rows));
#endif
  return result;
}
