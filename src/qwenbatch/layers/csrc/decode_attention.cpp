// Decode attention on the CPU: each decoding row's query heads against its sequence's context, read through the
// block tables from the paged KV cache in place (no per-step gather of the context), in one pass with the softmax
// taken online. Two kernels: decode_attention_bf16 takes both products on the stored bfloat16 values with
// AVX512-BF16's pair dot products (vdpbf16ps) where the CPU has them; decode_attention_f32 converts each block to
// float32 and runs plain FMAs, for every dtype and CPU.
#include "float_math.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QB_DOT_BF16 1
#endif

namespace {

using qb::from_f32;
using qb::to_f32;
using qb::vec_exp;

// The query heads of one KV head are the vector lanes, this many at a time (padded with zero heads), so neither
// product needs a horizontal sum; scores are taken this many positions side by side (independent FMA chains).
constexpr int64_t kLanes = 8, kPositions = 8;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// One call's tensors, as the entry point checked them. The cache is [2, blocks, block_size, kv_heads, head_dim].
template <typename T>
struct Problem {
  const T *q, *k_cache, *v_cache;
  const int32_t *tables, *lens;
  T* out;
  int64_t num_seqs, heads, kv_heads, head_dim, block_size, max_blocks;
  float scale;

  int64_t token_stride() const { return kv_heads * head_dim; }  // between positions of one block
  // Where sequence s's b-th block holds KV head h's row of its first position.
  int64_t head_offset(int64_t s, int64_t b, int64_t h) const {
    return tables[s * max_blocks + b] * block_size * token_stride() + h * head_dim;
  }
  // The blocks are scattered, so the hardware prefetchers lose the stream at each one: ask for a block's K and V
  // rows of a head while the one before is used.
  void prefetch_block(int64_t s, int64_t b, int64_t h) const {
    const int64_t at = head_offset(s, b, h), row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    const char* k = reinterpret_cast<const char*>(k_cache + at);
    const char* v = reinterpret_cast<const char*>(v_cache + at);
    const int64_t stride = token_stride() * static_cast<int64_t>(sizeof(T));
    for (int64_t p = 0; p < block_size; ++p)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(k + p * stride + byte);
        __builtin_prefetch(v + p * stride + byte);
      }
  }
};

// The online softmax step of one block for kLanes heads: scores ([position][lane], rows `stride` apart, n of them)
// become the block's weights exp(score - new maximum); the running maxima and sums move on, and `shrink` gets the
// factor the output so far must be multiplied by (0 on the first block).
inline void online_softmax_step(float* scores, int64_t stride, int64_t n, float* mx, float* sum, float* shrink) {
  float block_max[kLanes], block_sum[kLanes] = {};
  std::copy(mx, mx + kLanes, block_max);
  for (int64_t p = 0; p < n; ++p) {
    const float* sp = scores + p * stride;
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) block_max[l] = std::max(block_max[l], sp[l]);
  }
  for (int64_t p = 0; p < n; ++p) {
    float* sp = scores + p * stride;
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      sp[l] = vec_exp(sp[l] - block_max[l]);
      block_sum[l] += sp[l];
    }
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    shrink[l] = mx[l] == -std::numeric_limits<float>::infinity() ? 0.f : vec_exp(mx[l] - block_max[l]);
    sum[l] = sum[l] * shrink[l] + block_sum[l];
    mx[l] = block_max[l];
  }
}

// One (sequence, KV head) a task: its `group` query heads against the sequence's context, a cache block at a time.
// Each K and V byte is read once, from its block in place: the block's rows of this head are converted to float32
// into buffers that stay in L1, then used while there. scores[p][g] += K[p][i] * Q[g][i] runs kPositions positions
// side by side, and out[g][i] += P[p][g] * V[p][i] keeps a kLanes x kDims block of the output in registers across
// the block.
template <typename T>
void decode_attention_f32(const Problem<T>& pr) {
  constexpr int64_t kDims = 16;
  const T *q = pr.q, *k_cache = pr.k_cache, *v_cache = pr.v_cache;
  const int64_t heads = pr.heads, kv_heads = pr.kv_heads, head_dim = pr.head_dim, block_size = pr.block_size;
  const float scale = pr.scale;
  const int64_t group = heads / kv_heads;
  const int64_t lanes = round_up(group, kLanes);  // padded query heads
  const int64_t padded_block = round_up(block_size, kPositions);
  const int64_t token_stride = pr.token_stride();
  at::parallel_for(0, pr.num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // kf's rows past a block's end keep whatever they held: their scores are taken but never used.
    std::vector<float> qt(head_dim * lanes), kf(padded_block * head_dim, 0.f), vf(block_size * head_dim),
        scores(padded_block * lanes), acc(lanes * head_dim), mx(lanes), sum(lanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = pr.lens[s];
      std::fill(qt.begin(), qt.end(), 0.f);  // [lane chunk][dim][lane]
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          qt[((g / kLanes) * head_dim + i) * kLanes + g % kLanes] =
              to_f32(q[(s * heads + h * group + g) * head_dim + i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);  // [lane][dim], not yet divided by the sums
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += block_size) {
        const int64_t n = std::min(block_size, len - p0);
        if (p0 + block_size < len) pr.prefetch_block(s, b + 1, h);
        const int64_t base = pr.head_offset(s, b, h);
        for (int64_t p = 0; p < n; ++p) {
          const T* kp = k_cache + base + p * token_stride;
          const T* vp = v_cache + base + p * token_stride;
          float* kf_p = kf.data() + p * head_dim;
          float* vf_p = vf.data() + p * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) kf_p[i] = to_f32(kp[i]);
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) vf_p[i] = to_f32(vp[i]);
        }
        for (int64_t c = 0; c < lanes; c += kLanes) {
          const float* qc = qt.data() + c * head_dim;
          for (int64_t pb = 0; pb < n; pb += kPositions) {
            float dots[kPositions][kLanes] = {};
            for (int64_t i = 0; i < head_dim; ++i) {
              const float* qi = qc + i * kLanes;
              for (int64_t pp = 0; pp < kPositions; ++pp) {
                const float k = kf[(pb + pp) * head_dim + i];
#pragma omp simd
                for (int64_t l = 0; l < kLanes; ++l) dots[pp][l] += k * qi[l];
              }
            }
            for (int64_t pp = 0; pp < kPositions; ++pp)
              std::memcpy(scores.data() + (pb + pp) * lanes + c, dots[pp], sizeof(dots[pp]));
          }
          float shrink[kLanes];
          online_softmax_step(scores.data() + c, lanes, n, mx.data() + c, sum.data() + c, shrink);
          for (int64_t d0 = 0; d0 < head_dim; d0 += kDims) {
            float o[kLanes][kDims];
            for (int64_t l = 0; l < kLanes; ++l) {
              const float* a = acc.data() + (c + l) * head_dim + d0;
#pragma omp simd
              for (int64_t i = 0; i < kDims; ++i) o[l][i] = a[i] * shrink[l];
            }
            for (int64_t p = 0; p < n; ++p) {
              const float* sp = scores.data() + p * lanes + c;
              const float* vd = vf.data() + p * head_dim + d0;
              for (int64_t l = 0; l < kLanes; ++l) {
                const float w = sp[l];
#pragma omp simd
                for (int64_t i = 0; i < kDims; ++i) o[l][i] += w * vd[i];
              }
            }
            for (int64_t l = 0; l < kLanes; ++l)
              std::memcpy(acc.data() + (c + l) * head_dim + d0, o[l], sizeof(o[l]));
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / sum[g];
        for (int64_t i = 0; i < head_dim; ++i)
          pr.out[(s * heads + h * group + g) * head_dim + i] = from_f32<T>(acc[g * head_dim + i] * inv);
      }
    }
  });
}

#ifdef QB_DOT_BF16
// Two bf16 values (adjacent in memory) in every 32-bit lane: a vdpbf16ps operand that pairs them with another's.
inline uint32_t bf16_pair(const c10::BFloat16* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The same pass as decode_attention_f32 on a bfloat16 cache, with vdpbf16ps (each float32 lane += the sum of two
// bf16 products) reading K and V as stored: no float32 copies, half the instructions of the FMAs.
// - Q.K: the lanes are the heads; one instruction adds two dimensions' products for 8 heads, with K's pair of
//   dimensions broadcast. Products of bf16 values are exact in float32, so only the order of the sum differs from
//   float32 FMAs; the scale multiplies the dot products (Q stays exact).
// - P.V: the lanes are 16 dimensions; one instruction adds two positions' P * V for one head, V's two rows
//   interleaved (vpunpck{l,h}wd, so each accumulator holds every other group of 4 dimensions: `acc` keeps that
//   order until the output is written) and the head's two weights broadcast. The weights are rounded to bf16 for
//   it, as FlashAttention does on GPUs; their sums stay float32.
void decode_attention_bf16(const Problem<c10::BFloat16>& pr) {
  using bf16 = c10::BFloat16;
  const int64_t group = pr.heads / pr.kv_heads, chunks = round_up(group, kLanes) / kLanes;
  const int64_t dim_pairs = pr.head_dim / 2, zmms = pr.head_dim / 32;  // a row: dim_pairs words, zmms zmm loads
  const int64_t padded_block = round_up(pr.block_size, kPositions), token_stride = pr.token_stride();
  at::parallel_for(0, pr.num_seqs * pr.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> q_pairs(chunks * dim_pairs * kLanes);       // [chunk][dim pair][lane]
    std::vector<uint32_t> p_pairs(padded_block / 2 * kLanes);         // [position pair][lane]
    std::vector<float> scores(padded_block * kLanes), mx(chunks * kLanes), sum(chunks * kLanes);
    std::vector<float> acc(chunks * zmms * 2 * kLanes * 16);           // [chunk][zmm][lo/hi][lane][16]
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / pr.kv_heads, h = task % pr.kv_heads, len = pr.lens[s];
      std::fill(q_pairs.begin(), q_pairs.end(), 0u);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim_pairs; ++j)
          q_pairs[((g / kLanes) * dim_pairs + j) * kLanes + g % kLanes] =
              bf16_pair(pr.q + (s * pr.heads + h * group + g) * pr.head_dim + 2 * j);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const __m256 scale = _mm256_set1_ps(pr.scale);
      for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += pr.block_size) {
        const int64_t n = std::min(pr.block_size, len - p0);
        if (p0 + pr.block_size < len) pr.prefetch_block(s, b + 1, h);
        const bf16* k_block = pr.k_cache + pr.head_offset(s, b, h);
        const bf16* v_block = pr.v_cache + pr.head_offset(s, b, h);
        for (int64_t c = 0; c < chunks; ++c) {
          const uint32_t* qc = q_pairs.data() + c * dim_pairs * kLanes;
          for (int64_t pb = 0; pb < n; pb += kPositions) {
            const bf16* rows[kPositions];  // past the block's end: its last row again (scores discarded)
            for (int64_t i = 0; i < kPositions; ++i) rows[i] = k_block + std::min(pb + i, n - 1) * token_stride;
            __m256 dots[kPositions];
            for (int64_t i = 0; i < kPositions; ++i) dots[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < dim_pairs; ++j) {
              const __m256bh qj = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + j * kLanes));
              for (int64_t i = 0; i < kPositions; ++i)
                dots[i] = _mm256_dpbf16_ps(dots[i], qj, (__m256bh)_mm256_set1_epi32(bf16_pair(rows[i] + 2 * j)));
            }
            for (int64_t i = 0; i < kPositions; ++i)
              _mm256_storeu_ps(scores.data() + (pb + i) * kLanes, _mm256_mul_ps(dots[i], scale));
          }
          float shrink[kLanes];
          online_softmax_step(scores.data(), kLanes, n, mx.data() + c * kLanes, sum.data() + c * kLanes, shrink);
          const int64_t pairs = (n + 1) / 2;
          for (int64_t k = 0; k < pairs; ++k)
            for (int64_t l = 0; l < kLanes; ++l) {
              const uint32_t lo = from_f32<bf16>(scores[2 * k * kLanes + l]).x;
              const uint32_t hi = 2 * k + 1 < n ? from_f32<bf16>(scores[(2 * k + 1) * kLanes + l]).x : 0u;
              p_pairs[k * kLanes + l] = lo | hi << 16;
            }
          for (int64_t z = 0; z < zmms; ++z) {
            float* a = acc.data() + (c * zmms + z) * 2 * kLanes * 16;
            __m512 lo_acc[kLanes], hi_acc[kLanes];
            for (int64_t l = 0; l < kLanes; ++l) {
              const __m512 f = _mm512_set1_ps(shrink[l]);
              lo_acc[l] = _mm512_mul_ps(_mm512_loadu_ps(a + l * 16), f);
              hi_acc[l] = _mm512_mul_ps(_mm512_loadu_ps(a + (kLanes + l) * 16), f);
            }
            for (int64_t k = 0; k < pairs; ++k) {
              const bf16* v0 = v_block + 2 * k * token_stride + z * 32;
              const __m512i r0 = _mm512_loadu_si512(v0);
              // An odd block's last pair takes zeros, not the next slot: that may hold anything, NaN included.
              const __m512i r1 = 2 * k + 1 < n ? _mm512_loadu_si512(v0 + token_stride) : _mm512_setzero_si512();
              const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1), hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
              for (int64_t l = 0; l < kLanes; ++l) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[k * kLanes + l]));
                lo_acc[l] = _mm512_dpbf16_ps(lo_acc[l], lo, w);
                hi_acc[l] = _mm512_dpbf16_ps(hi_acc[l], hi, w);
              }
            }
            for (int64_t l = 0; l < kLanes; ++l) {
              _mm512_storeu_ps(a + l * 16, lo_acc[l]);
              _mm512_storeu_ps(a + (kLanes + l) * 16, hi_acc[l]);
            }
          }
        }
      }
      // Undo the interleaving: dimension d of zmm z sits in 128-bit lane (d % 32) / 8, at 4-word offset d % 4 of
      // the lo accumulator for d % 8 < 4, else of the hi one.
      for (int64_t g = 0; g < group; ++g) {
        const int64_t c = g / kLanes, l = g % kLanes;
        const float inv = 1.f / sum[g];
        bf16* o = pr.out + (s * pr.heads + h * group + g) * pr.head_dim;
        for (int64_t d = 0; d < pr.head_dim; ++d) {
          const int64_t z = d / 32, w = d % 32, half = (w % 8) / 4;
          o[d] = from_f32<bf16>(acc[(((c * zmms + z) * 2 + half) * kLanes + l) * 16 + (w / 8) * 4 + w % 4] * inv);
        }
      }
    }
  });
}
#endif

// The bf16 kernel where the CPU and the shapes allow, else the float32 one.
template <typename T>
void decode_attention(const Problem<T>& pr) {
#ifdef QB_DOT_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pr.head_dim % 32 == 0) return decode_attention_bf16(pr);
  }
#endif
  decode_attention_f32(pr);
}

}  // namespace

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
              decode_attention(Problem<scalar_t>{qc.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                                                 kv_cache.data_ptr<scalar_t>() + half, tables.data_ptr<int32_t>(),
                                                 lc.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), D, heads,
                                                 kv_heads, head_dim, block_size, tables.size(1),
                                                 static_cast<float>(scale)}));
  return out;
}
