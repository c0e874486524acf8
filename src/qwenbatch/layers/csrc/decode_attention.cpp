// Decode attention on the CPU: each decoding row's query heads against its sequence's context, read through the
// block tables from the paged KV cache in place (no per-step gather of the context), the softmax taken online.
// Two kernels share the task plan (attend_all): a float32 one for every dtype and CPU (each block converted to
// float32 in L1, plain FMAs), and, for bf16 caches on AVX512-BF16, one whose scores come from the stored bf16 values
// by vdpbf16ps (Bf16Worker): 1.6-2.0x the float32 kernel from memory, 1.7-2.4x from cache, on the default model's
// shapes (benchmarks/decode_attention_micro.py, Zen 5). An earlier bf16 kernel (issue 15's sixth session) ran 1.8x from
// cache but no faster from memory, which a real step reads from; that one kept the online softmax's reductions once
// every 16 positions, and took each block's K and V into L1 together. Where the CPU has AMX, the bf16 kernel takes
// its scores on tiles: 1.17-1.26x the vdpbf16ps scores from memory, 1.3-1.5x from cache (the AMX kind).
#include "amx.h"
#include "bf16_vectors.h"
#include "float_math.h"
#include "index_math.h"
#include "ops.h"
#include "prefetch.h"

#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using qb::from_f32;
using qb::to_f32;
using qb::vec_exp;

// The query heads of one KV head are the vector lanes, this many at a time (padded with zero heads), so neither
// product needs a horizontal sum; scores are taken this many positions side by side (independent FMA chains).
constexpr int64_t kLanes = 8, kPositions = 8;
// How many blocks ahead of the one in use a task prefetches: from memory, 16 sequences x 450 positions took 367 us
// a layer one block ahead, ~290 two ahead, 350-410 three or five ahead (benchmarks/decode_attention_micro.py, Zen 5,
// whole blocks asked for at once). Asked for a row at a time (F32Worker), three ahead ran as two (AVX2 kind).
constexpr int64_t kBlocksAhead = 2;

// Where the (sequence, KV head) pairs are fewer than the threads, each sequence's context is cut into this many
// runs of blocks at most, each run a task, and the runs' partial softmax sums merged (FlashDecoding's split-K):
// one long sequence of the 0.5B model (2 KV heads) would otherwise run on 2 threads however many the machine has.
// The longest context's runs cover this many positions at the least, so that a partial result is worth its merge
// (shorter contexts in the same call get shorter runs, or empty ones).
constexpr int64_t kMinSplitPositions = 256;

using qb::ceil_div;
using qb::round_up;

// How many runs each sequence's context is cut into: 1 wherever the pairs alone give every thread a task, else
// about two tasks a thread, as far as the longest context has runs of kMinSplitPositions.
inline int64_t context_splits(int64_t pairs, int64_t threads, int64_t longest) {
  if (pairs == 0 || pairs >= threads) return 1;
  return std::max<int64_t>(1, std::min(ceil_div(2 * threads, pairs), longest / kMinSplitPositions));
}

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
  // The blocks are scattered, so the hardware prefetchers lose the stream at each one: a head's K and V rows of a
  // block are asked for before the block is used, all at once (prefetch_block) or a row at a time (prefetch_row).
  // (Until GCC was found dropping __builtin_prefetch, these were never issued: 16 sequences x 450 positions took
  // 500 us a layer from memory, 367 with them, 204 from cache.)
  void prefetch_block(int64_t s, int64_t b, int64_t h) const {
    const int64_t at = head_offset(s, b, h);
    for (int64_t p = 0; p < block_size; ++p) prefetch_row(at, p);
  }
  // The same for one position p of the block whose head row starts at `at` (head_offset).
  void prefetch_row(int64_t at, int64_t p) const {
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    const char* k = reinterpret_cast<const char*>(k_cache + at + p * token_stride());
    const char* v = reinterpret_cast<const char*>(v_cache + at + p * token_stride());
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      qb::prefetch_l1(k + byte);
      qb::prefetch_l1(v + byte);
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

// The float32 kernel, for every dtype and CPU: one (sequence, KV head, run of the context's blocks) a task, its
// `group` query heads against the run, a cache block at a time.
// Each K and V byte is read once, from its block in place: the block's rows of this head are converted to float32
// into buffers that stay in L1, then used while there. scores[p][g] += K[p][i] * Q[g][i] runs kPositions positions
// side by side, and out[g][i] += P[p][g] * V[p][i] keeps a kLanes x kDims block of the output in registers across
// the block.
template <typename T>
class F32Worker {
 public:
  explicit F32Worker(const Problem<T>& pr)
      : pr_(pr),
        group_(pr.heads / pr.kv_heads),
        lanes_(round_up(group_, kLanes)),
        qt_(pr.head_dim * lanes_),
        kf_(round_up(pr.block_size, kPositions) * pr.head_dim, 0.f),
        vf_(pr.block_size * pr.head_dim),
        scores_(round_up(pr.block_size, kPositions) * lanes_),
        acc(lanes_ * pr.head_dim),
        mx(lanes_),
        sum(lanes_) {}

  // Sequence s's KV head h against blocks [b_begin, b_end) of its context: acc[g][i] (not yet divided by the sums),
  // mx[g] and sum[g] for its query heads g.
  void attend(int64_t s, int64_t h, int64_t b_begin, int64_t b_end) {
    constexpr int64_t kDims = 16;
    const Problem<T>& pr = pr_;
    const int64_t head_dim = pr.head_dim, block_size = pr.block_size, lanes = lanes_, len = pr.lens[s];
    std::fill(qt_.begin(), qt_.end(), 0.f);  // [lane chunk][dim][lane]
    for (int64_t g = 0; g < group_; ++g)
      for (int64_t i = 0; i < head_dim; ++i)
        qt_[((g / kLanes) * head_dim + i) * kLanes + g % kLanes] =
            to_f32(pr.q[(s * pr.heads + h * group_ + g) * head_dim + i]) * pr.scale;
    std::fill(acc.begin(), acc.end(), 0.f);  // [lane][dim]
    std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.end(), 0.f);
    // kf's rows past a block's end keep whatever they held: their scores are taken but never used.
    float *kf = kf_.data(), *vf = vf_.data(), *scores = scores_.data();
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t p0 = b * block_size, n = std::min(block_size, len - p0);
      for (int64_t ahead = 1; b == b_begin && ahead < kBlocksAhead; ++ahead)
        if (b + ahead < b_end) pr.prefetch_block(s, b + ahead, h);
      // The block kBlocksAhead on is asked for a row at a time as this one's rows are converted. Asked for whole
      // (128 prefetches at once for float32 rows of 64 in blocks of 16, more than a core's miss buffers hold), the
      // conversion's loads still waited on memory for 36% of the kernel's time (64 sequences x 320 positions, perf);
      // row by row, the kernel ran 1.04-1.16x from memory (benchmarks/decode_attention_micro.py, AVX2 kind).
      const int64_t ahead_at = b + kBlocksAhead < b_end ? pr.head_offset(s, b + kBlocksAhead, h) : -1;
      const int64_t base = pr.head_offset(s, b, h);
      for (int64_t p = 0; p < n; ++p) {
        if (ahead_at >= 0) pr.prefetch_row(ahead_at, p);
        const T* kp = pr.k_cache + base + p * pr.token_stride();
        const T* vp = pr.v_cache + base + p * pr.token_stride();
        float* kf_p = kf + p * head_dim;
        float* vf_p = vf + p * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) kf_p[i] = to_f32(kp[i]);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) vf_p[i] = to_f32(vp[i]);
      }
      for (int64_t c = 0; c < lanes; c += kLanes) {
        const float* qc = qt_.data() + c * head_dim;
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
            std::memcpy(scores + (pb + pp) * lanes + c, dots[pp], sizeof(dots[pp]));
        }
        float shrink[kLanes];
        online_softmax_step(scores + c, lanes, n, mx.data() + c, sum.data() + c, shrink);
        for (int64_t d0 = 0; d0 < head_dim; d0 += kDims) {
          float o[kLanes][kDims];
          for (int64_t l = 0; l < kLanes; ++l) {
            const float* a = acc.data() + (c + l) * head_dim + d0;
#pragma omp simd
            for (int64_t i = 0; i < kDims; ++i) o[l][i] = a[i] * shrink[l];
          }
          for (int64_t p = 0; p < n; ++p) {
            const float* sp = scores + p * lanes + c;
            const float* vd = vf + p * head_dim + d0;
            for (int64_t l = 0; l < kLanes; ++l) {
              const float w = sp[l];
#pragma omp simd
              for (int64_t i = 0; i < kDims; ++i) o[l][i] += w * vd[i];
            }
          }
          for (int64_t l = 0; l < kLanes; ++l) std::memcpy(acc.data() + (c + l) * head_dim + d0, o[l], sizeof(o[l]));
        }
      }
    }
  }

 private:
  const Problem<T>& pr_;
  const int64_t group_, lanes_;  // query heads of a KV head, and as many padded to whole vectors
  std::vector<float> qt_, kf_, vf_, scores_;

 public:
  std::vector<float> acc, mx, sum;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QB_DECODE_BF16 1

// Transposes 16 rows of 16 32-bit words in place: r[j] becomes word j of every row (row p in lane p).
__attribute__((always_inline)) inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within each 128-bit lane: pairs of rows interleaved word by word ...
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // ... then 4 x 4 blocks: r[i + c] holds word 4L + c of rows i .. i + 3, lane L
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the four row groups' lanes L brought together: word 4L + c of all 16 rows
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The kernel for bf16 caches on AVX512-BF16, for G query heads a KV head (every Qwen model has 2 to 8).
// - Scores: 16 positions at a time are the lanes. Their K rows, transposed in registers into [dim pair][position]
//   words, meet each query head's dimension pairs in vdpbf16ps: bf16 products are exact in float32 and summed
//   there, so the scores are the float32 kernel's (up to the order of the sums), 2 x 16 multiply-adds an
//   instruction rather than 8.
// - Softmax: a span of up to 512 positions' scores is taken first, then its weights, then its share of the output:
//   the maxima, sums and the output's rescaling come once a span. Once every 16 positions, they were a third of the
//   kernel's time (the horizontal reductions' latencies, and a scalar exp for each head's rescaling).
// - P . V stays in float32 FMAs, the weights unrounded (to bf16 they would err by up to 2^-9 each): each V row
//   converted in registers, 2 x 16 dimensions of G heads' outputs held in registers across the span.
constexpr int64_t kBf16MaxDims = 256;  // the bf16 kernel's largest head_dim

template <int G>
class Bf16Worker {
 public:
  explicit Bf16Worker(const Problem<c10::BFloat16>& pr) : pr_(pr), acc(G * pr.head_dim), mx(G), sum(G) {
#ifdef QB_AMX
    amx_ = qb::amx_permitted();
    if (amx_) qb::configure_tiles();
#endif
  }
#ifdef QB_AMX
  ~Bf16Worker() {
    if (amx_) _tile_release();
  }
#endif
  Bf16Worker(const Bf16Worker&) = delete;
  Bf16Worker& operator=(const Bf16Worker&) = delete;

  // As F32Worker::attend: acc, mx and sum of the task's G query heads.
  void attend(int64_t s, int64_t h, int64_t b_begin, int64_t b_end) {
    const Problem<c10::BFloat16>& pr = pr_;
    const int64_t len = pr.lens[s];
    q_ = reinterpret_cast<const uint32_t*>(pr.q + (s * pr.heads + h * G) * pr.head_dim);
#ifdef QB_AMX
    if (amx_) {  // the B tiles, [dimension pair][head], heads past G zero
      const int64_t pairs = pr.head_dim / 2;
      std::fill(q_tiles_, q_tiles_ + pairs * 16, 0u);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < pairs; ++j) q_tiles_[j * 16 + g] = q_[g * pairs + j];
    }
#endif
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.end(), 0.f);
    int64_t count = 0;
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t n = std::min(pr.block_size, len - b * pr.block_size);
      const int64_t base = pr.head_offset(s, b, h);
      for (int64_t p = 0; p < n; p += 16) {
        chunks_[count++] = {base + p * pr.token_stride(), std::min<int64_t>(16, n - p)};
        if (count == kSpanChunks) span(std::exchange(count, 0));
      }
    }
    if (count > 0) span(count);
  }

 private:
  static constexpr int64_t kSpanChunks = 32;  // of up to 16 positions: a span's scores, G x 2 KB, stay in L1
  // How far ahead of its use a span's next rows are asked for (see prefetch): 3 steps ran 1.04-1.07x as fast as 2
  // from memory, as fast as 4 or 6 (decode_attention_micro.py --base, Zen 5).
  static constexpr int64_t kStepsAhead = 3;
  struct Chunk {
    int64_t offset;  // of its first position's K (and V) row in the cache
    int64_t n;       // positions, 1 to 16
  };

  static __mmask16 live(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

  // The first `count` chunks: their scores, the softmax's step, their share of the output.
  void span(int64_t count) {
    const int64_t head_dim = pr_.head_dim;
    for (int64_t step = 0; step < kStepsAhead; ++step) prefetch(step, count);
    for (int64_t c = 0; c < count; ++c) {
      prefetch(c + kStepsAhead, count);
      prefetch_values_l2(chunks_[c]);
      scores(chunks_[c], c);
    }
    float shrink[G];
    for (int g = 0; g < G; ++g) {
      float* w = weights_[g];
      __m512 top = _mm512_set1_ps(mx[g]);
      for (int64_t c = 0; c < count; ++c)
        top = _mm512_mask_max_ps(top, live(chunks_[c].n), top, _mm512_load_ps(w + 16 * c));
      const float new_mx = _mm512_reduce_max_ps(top);
#pragma omp simd
      for (int64_t i = 0; i < 16 * count; ++i) w[i] = vec_exp(w[i] - new_mx);
      __m512 added = _mm512_setzero_ps();
      for (int64_t c = 0; c < count; ++c)
        added = _mm512_add_ps(added, _mm512_maskz_load_ps(live(chunks_[c].n), w + 16 * c));
      shrink[g] = mx[g] == -std::numeric_limits<float>::infinity() ? 0.f : vec_exp(mx[g] - new_mx);
      sum[g] = sum[g] * shrink[g] + _mm512_reduce_add_ps(added);
      mx[g] = new_mx;
    }
    const int64_t stride = pr_.token_stride();
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
      __m512 o[G][2];
      for (int g = 0; g < G; ++g)
        for (int z = 0; z < 2; ++z)
          o[g][z] = _mm512_mul_ps(_mm512_loadu_ps(acc.data() + g * head_dim + d0 + 16 * z), _mm512_set1_ps(shrink[g]));
      for (int64_t c = 0; c < count; ++c) {
        prefetch((1 + d0 / 32) * count + c + kStepsAhead, count);
        const c10::BFloat16* v = pr_.v_cache + chunks_[c].offset + d0;
        for (int64_t p = 0; p < chunks_[c].n; ++p) {
          __m512 vz[2];
          for (int z = 0; z < 2; ++z) vz[z] = qb::load_bf16x16(v + p * stride + 16 * z);
          for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(weights_[g][16 * c + p]);
            for (int z = 0; z < 2; ++z) o[g][z] = _mm512_fmadd_ps(w, vz[z], o[g][z]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int z = 0; z < 2; ++z) _mm512_storeu_ps(acc.data() + g * head_dim + d0 + 16 * z, o[g][z]);
    }
  }

  // Asks for step `step` of a span of `count` chunks into L1, if there is one: steps [0, count) are the chunks' K rows,
  // then each 32-dimension pass of P . V reads 64 bytes of every V row, chunk by chunk, steps [(1 + pass) count,
  // (2 + pass) count). Each pass asks for its own rows only: with a chunk's K and V both asked for as its scores
  // were taken, P . V waited on V loads for a third of the kernel's time (perf), and from memory 64 sequences x 320
  // positions took 680 us a layer against ~500 so (Zen 5).
  void prefetch(int64_t step, int64_t count) const {
    if (step >= count * (1 + pr_.head_dim / 32)) return;
    const Chunk& chunk = chunks_[step % count];
    const int64_t stride = pr_.token_stride();
    if (step < count) {
      const char* k = reinterpret_cast<const char*>(pr_.k_cache + chunk.offset);
      for (int64_t p = 0; p < chunk.n; ++p)
        for (int64_t byte = 0; byte < pr_.head_dim * 2; byte += 64) qb::prefetch_l1(k + p * stride * 2 + byte);
      return;
    }
    const c10::BFloat16* v = pr_.v_cache + chunk.offset + (step / count - 1) * 32;
    for (int64_t p = 0; p < chunk.n; ++p) qb::prefetch_l1(v + p * stride);
  }

  // Asks for a chunk's V rows of this head into L2 as its scores are taken, a span before P . V reads them, so that V
  // streams in under the scores' arithmetic rather than behind P . V's own prefetches into L1: 1.13-1.29x from
  // memory at 1 x 450 to 64 x 1,024, no change from cache (decode_attention_micro.py --base, AMX kind). K asked into
  // L2 as well, 4 to 16 chunks ahead, added nothing; both heads' rows (the whole 4 KB block) lost 5-15%.
  void prefetch_values_l2(const Chunk& chunk) const {
    const char* v = reinterpret_cast<const char*>(pr_.v_cache + chunk.offset);
    const int64_t stride = pr_.token_stride() * static_cast<int64_t>(sizeof(c10::BFloat16));
    for (int64_t p = 0; p < chunk.n; ++p)
      for (int64_t byte = 0; byte < pr_.head_dim * 2; byte += 64) qb::prefetch_l2(v + p * stride + byte);
  }

  // Chunk c's scores (scale included) into weights_[g][16 c ..]; lanes past its positions hold scores of zeros.
  void scores(const Chunk& chunk, int64_t c) {
#ifdef QB_AMX
    if (amx_) return scores_amx(chunk, c);
#endif
    scores_avx512(chunk, c);
  }

#ifdef QB_AMX
  // On AMX: the chunk's K rows, as stored, are the A tiles (16 positions x 32 dimensions each), the query heads' pairs
  // the B tiles, so C holds [position][head] without the K transposes and G x head_dim / 2 vdpbf16ps of the AVX-512
  // path; C is transposed once to the weights' [head][position]. Products of bf16 are exact in float32 on both paths.
  void scores_amx(const Chunk& chunk, int64_t c) {
    const int64_t head_dim = pr_.head_dim;
    const void* rows = pr_.k_cache + chunk.offset;
    int64_t stride = pr_.token_stride() * static_cast<int64_t>(sizeof(c10::BFloat16));
    if (chunk.n < 16) {  // rows past the chunk are zeros: they may lie past the cache's end
      std::memset(k_rows_, 0, 16 * head_dim * sizeof(c10::BFloat16));
      for (int64_t p = 0; p < chunk.n; ++p)
        std::memcpy(k_rows_ + p * head_dim, pr_.k_cache + chunk.offset + p * pr_.token_stride(), head_dim * 2);
      rows = k_rows_;
      stride = head_dim * static_cast<int64_t>(sizeof(c10::BFloat16));
    }
    _tile_zero(0);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
      _tile_loadd(1, static_cast<const char*>(rows) + 2 * d0, stride);
      _tile_loadd(2, q_tiles_ + d0 / 2 * 16, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c_tile_, 64);
    __m512i r[16];
    for (int p = 0; p < 16; ++p) r[p] = _mm512_load_si512(c_tile_ + 16 * p);
    transpose16(r);
    const __m512 scale = _mm512_set1_ps(pr_.scale);
    for (int g = 0; g < G; ++g) _mm512_store_ps(weights_[g] + 16 * c, _mm512_mul_ps(_mm512_castsi512_ps(r[g]), scale));
  }
#endif

  void scores_avx512(const Chunk& chunk, int64_t c) {
    const int64_t pairs = pr_.head_dim / 2, stride = pr_.token_stride();
    const c10::BFloat16* k = pr_.k_cache + chunk.offset;
    for (int64_t w0 = 0; w0 < pairs; w0 += 16) {
      __m512i r[16];
      if (chunk.n == 16) {
        for (int64_t p = 0; p < 16; ++p) r[p] = _mm512_loadu_si512(k + p * stride + 2 * w0);
      } else {  // rows past the chunk are zeros: they may lie past the cache's end
        for (int64_t p = 0; p < 16; ++p)
          r[p] = p < chunk.n ? _mm512_loadu_si512(k + p * stride + 2 * w0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(kt_ + (w0 + j) * 16, r[j]);
    }
    // Two chains a head (even and odd pairs), so that a few heads still keep vdpbf16ps' latency covered.
    __m512 dots[G][2];
    for (int g = 0; g < G; ++g) dots[g][0] = dots[g][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j += 2)
      for (int i = 0; i < 2; ++i) {
        const __m512bh kj = (__m512bh)_mm512_load_si512(kt_ + (j + i) * 16);
        for (int g = 0; g < G; ++g)
          dots[g][i] =
              _mm512_dpbf16_ps(dots[g][i], kj, (__m512bh)_mm512_set1_epi32(static_cast<int>(q_[g * pairs + j + i])));
      }
    const __m512 scale = _mm512_set1_ps(pr_.scale);
    for (int g = 0; g < G; ++g)
      _mm512_store_ps(weights_[g] + 16 * c, _mm512_mul_ps(_mm512_add_ps(dots[g][0], dots[g][1]), scale));
  }

  const Problem<c10::BFloat16>& pr_;
  const uint32_t* q_ = nullptr;  // the task's G query heads, rows of dimension-pair words
  Chunk chunks_[kSpanChunks];
  alignas(64) uint32_t kt_[kBf16MaxDims / 2 * 16];  // a chunk's K rows transposed: [dim pair][position]
  alignas(64) float weights_[G][kSpanChunks * 16];   // the span's scores, then its weights
#ifdef QB_AMX
  bool amx_ = false;
  alignas(64) uint32_t q_tiles_[kBf16MaxDims / 2 * 16];                // the task's B tiles
  alignas(64) float c_tile_[16 * 16];                                  // a chunk's scores, [position][head]
  alignas(64) c10::BFloat16 k_rows_[16 * kBf16MaxDims];                // a partial chunk's K rows, zero-padded
#endif

 public:
  std::vector<float> acc, mx, sum;
};
#endif

// Runs a kernel's Worker over the call's tasks, (sequence, KV head, run of the context) each, and writes the output:
// each task's heads divided by their sums, or, where contexts are cut into runs, the runs' partial results merged.
template <typename T, typename Worker>
void attend_all(const Problem<T>& pr, int64_t splits) {
  const int64_t heads = pr.heads, kv_heads = pr.kv_heads, head_dim = pr.head_dim, block_size = pr.block_size;
  const int64_t group = heads / kv_heads;
  // With splits, each run's output (not yet divided by its sum), maximum and sum: [seq][kv head][run][group ...].
  std::vector<float> run_acc(splits > 1 ? pr.num_seqs * heads * splits * head_dim : 0),
      run_mx(splits > 1 ? pr.num_seqs * heads * splits : 0), run_sum(run_mx.size());
  // Task t's blocks [first, second) of its sequence.
  const auto blocks_of = [&](int64_t task) -> std::pair<int64_t, int64_t> {
    const int64_t blocks = ceil_div(pr.lens[task / (kv_heads * splits)], block_size);
    const int64_t per_run = ceil_div(blocks, splits), b_begin = std::min(blocks, task % splits * per_run);
    return {b_begin, std::min(blocks, b_begin + per_run)};
  };
  // Each worker takes a contiguous share of the tasks in row order (both KV heads of a sequence on one thread, the
  // cache lines they share read once), unless that leaves a worker over 25% above the mean: then the longest tasks
  // go first, each worker claiming the next as it finishes. In row order a step's long contexts went to one thread
  // (lengths 4,000, 100, 100, 100 on 2 threads: 8,100 positions to one, 500 to the other); claimed longest first
  // always, contexts of equal length ran 0.95x (benchmarks/split_work_ab.py, Zen 5).
  const int64_t tasks = pr.num_seqs * kv_heads * splits;
  if (tasks == 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks), share = ceil_div(tasks, workers);
  std::vector<int64_t> order;  // empty: shares in row order
  int64_t total = 0, busiest = 0;
  for (int64_t w = 0; w < workers; ++w) {
    int64_t work = 0;
    for (int64_t t = w * share; t < std::min(tasks, (w + 1) * share); ++t) {
      const auto [b0, b1] = blocks_of(t);
      work += b1 - b0;
    }
    total += work;
    busiest = std::max(busiest, work);
  }
  if (4 * busiest * workers > 5 * total) {
    order.resize(tasks);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const auto [a0, a1] = blocks_of(a);
      const auto [b0, b1] = blocks_of(b);
      return a1 - a0 > b1 - b0;
    });
  }
  std::atomic<int64_t> next{0};
  const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t end_worker) {
    Worker worker(pr);
    const bool in_order = order.empty();
    const int64_t first = in_order ? first_worker * share : claim();
    const int64_t stop = in_order ? std::min(tasks, end_worker * share) : tasks;
    for (int64_t claimed = first; claimed < stop; claimed = in_order ? claimed + 1 : claim()) {
      const int64_t task = in_order ? claimed : order[claimed];
      const int64_t s = task / (kv_heads * splits), h = task / splits % kv_heads, run = task % splits;
      const auto [b_begin, b_end] = blocks_of(task);
      worker.attend(s, h, b_begin, b_end);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = s * heads + h * group + g;
        const float* acc = worker.acc.data() + g * head_dim;
        if (splits > 1) {
          std::memcpy(run_acc.data() + (head * splits + run) * head_dim, acc, head_dim * sizeof(float));
          run_mx[head * splits + run] = worker.mx[g];
          run_sum[head * splits + run] = worker.sum[g];
          continue;
        }
        const float inv = 1.f / worker.sum[g];
        for (int64_t i = 0; i < head_dim; ++i) pr.out[head * head_dim + i] = from_f32<T>(acc[i] * inv);
      }
    }
  });
  if (splits == 1) return;
  // Each query head's runs merged: sums and outputs rescaled to the largest of the runs' maxima (a run past the
  // context's end holds none: its maximum is -inf, its weight 0; the first run always holds a position).
  at::parallel_for(0, pr.num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t head = begin; head < end; ++head) {
      const float* mx = run_mx.data() + head * splits;
      const float top = *std::max_element(mx, mx + splits);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t run = 0; run < splits; ++run) {
        if (mx[run] == -std::numeric_limits<float>::infinity()) continue;
        const float weight = vec_exp(mx[run] - top);
        total += weight * run_sum[head * splits + run];
        const float* a = run_acc.data() + (head * splits + run) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) merged[i] += weight * a[i];
      }
      for (int64_t i = 0; i < head_dim; ++i) pr.out[head * head_dim + i] = from_f32<T>(merged[i] / total);
    }
  });
}

// The kernel for the call: the bf16 one where it is built and fits the heads, else the float32 one.
template <typename T>
void decode_attention(const Problem<T>& pr, int64_t splits) {
#ifdef QB_DECODE_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pr.head_dim % 32 == 0 && pr.head_dim <= kBf16MaxDims) {
      switch (pr.heads / pr.kv_heads) {
        case 1: return attend_all<T, Bf16Worker<1>>(pr, splits);
        case 2: return attend_all<T, Bf16Worker<2>>(pr, splits);
        case 3: return attend_all<T, Bf16Worker<3>>(pr, splits);
        case 4: return attend_all<T, Bf16Worker<4>>(pr, splits);
        case 5: return attend_all<T, Bf16Worker<5>>(pr, splits);
        case 6: return attend_all<T, Bf16Worker<6>>(pr, splits);
        case 7: return attend_all<T, Bf16Worker<7>>(pr, splits);
        case 8: return attend_all<T, Bf16Worker<8>>(pr, splits);
        default: break;
      }
    }
  }
#endif
  attend_all<T, F32Worker<T>>(pr, splits);
}

}  // namespace

std::string decode_attention_isa() {
#ifdef QB_AMX
  if (qb::amx_permitted()) return "amx";
#endif
#ifdef QB_DECODE_BF16
  return "avx512-bf16";
#else
  return "float32";
#endif
}

// q: [D, heads, head_dim]; kv_cache: [2, blocks, block_size, kv_heads, head_dim]; block_tables: int32 [D, max_blocks];
// lens: int32 [D] (context lengths, the new token's K/V already stored). Returns [D, heads, head_dim].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && lens.dim() == 1,
              "paged_decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && kv_cache.is_contiguous(),
              "paged_decode_attention: q and a contiguous cache of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "paged_decode_attention: int32 block tables and lengths");
  const int64_t D = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(head_dim % 16 == 0 && kv_cache.size(4) == head_dim && heads % kv_heads == 0,
              "paged_decode_attention: head shapes do not fit");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lc = lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t half = kv_cache.numel() / 2;
  const int32_t* lp = lc.data_ptr<int32_t>();
  const int64_t longest = D > 0 ? *std::max_element(lp, lp + D) : 0;
  const int64_t splits = context_splits(D * kv_heads, at::get_num_threads(), longest);
  QB_DISPATCH(q.scalar_type(), "paged_decode_attention",
              decode_attention(Problem<scalar_t>{qc.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                                                 kv_cache.data_ptr<scalar_t>() + half, tables.data_ptr<int32_t>(),
                                                 lc.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), D, heads, kv_heads,
                                                 head_dim, block_size, tables.size(1), static_cast<float>(scale)},
                               splits));
  return out;
}
