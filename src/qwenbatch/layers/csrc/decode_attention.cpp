// Decode attention on the CPU: each decoding row's query heads against its sequence's context, read through the
// block tables from the paged KV cache in place (no per-step gather of the context), in one pass with the softmax
// taken online: each block converted to float32 in L1, plain FMAs, for every dtype and CPU. (A second kernel on the
// stored bf16 values with AVX512-BF16's pair dot products ran 1.8x faster from cache but no faster end to end: a
// real step finds its KV in memory, and waits on it. BENCHMARKS.md, issue 15's sixth and seventh sessions. That was
// measured while GCC dropped this kernel's prefetches; with them, from memory takes 1.4-1.5x from cache, not 2.5x.)
#include "float_math.h"
#include "ops.h"
#include "prefetch.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
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
// a layer one block ahead, ~290 two ahead, 350-410 three or five ahead (benchmarks/decode_attention_micro.py, Zen 5).
constexpr int64_t kBlocksAhead = 2;

// Where the (sequence, KV head) pairs are fewer than the threads, each sequence's context is cut into this many
// runs of blocks at most, each run a task, and the runs' partial softmax sums merged (FlashDecoding's split-K):
// one long sequence of the 0.5B model (2 KV heads) would otherwise run on 2 threads however many the machine has.
// The longest context's runs cover this many positions at the least, so that a partial result is worth its merge
// (shorter contexts in the same call get shorter runs, or empty ones).
constexpr int64_t kMinSplitPositions = 256;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
  // The blocks are scattered, so the hardware prefetchers lose the stream at each one: ask for a block's K and V
  // rows of a head kBlocksAhead blocks before it is used. (Until GCC was found dropping __builtin_prefetch, these
  // were never issued: 16 sequences x 450 positions took 500 us a layer from memory, 367 with them, 204 from cache.)
  void prefetch_block(int64_t s, int64_t b, int64_t h) const {
    const int64_t at = head_offset(s, b, h), row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    const char* k = reinterpret_cast<const char*>(k_cache + at);
    const char* v = reinterpret_cast<const char*>(v_cache + at);
    const int64_t stride = token_stride() * static_cast<int64_t>(sizeof(T));
    for (int64_t p = 0; p < block_size; ++p)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        qb::prefetch_l1(k + p * stride + byte);
        qb::prefetch_l1(v + p * stride + byte);
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

// One (sequence, KV head, run of the context's blocks) a task: its `group` query heads against the run, a cache
// block at a time.
// Each K and V byte is read once, from its block in place: the block's rows of this head are converted to float32
// into buffers that stay in L1, then used while there. scores[p][g] += K[p][i] * Q[g][i] runs kPositions positions
// side by side, and out[g][i] += P[p][g] * V[p][i] keeps a kLanes x kDims block of the output in registers across
// the block.
template <typename T>
void decode_attention_f32(const Problem<T>& pr, int64_t splits) {
  constexpr int64_t kDims = 16;
  const T *q = pr.q, *k_cache = pr.k_cache, *v_cache = pr.v_cache;
  const int64_t heads = pr.heads, kv_heads = pr.kv_heads, head_dim = pr.head_dim, block_size = pr.block_size;
  const float scale = pr.scale;
  const int64_t group = heads / kv_heads;
  const int64_t lanes = round_up(group, kLanes);  // padded query heads
  const int64_t padded_block = round_up(block_size, kPositions);
  const int64_t token_stride = pr.token_stride();
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
    // kf's rows past a block's end keep whatever they held: their scores are taken but never used.
    std::vector<float> qt(head_dim * lanes), kf(padded_block * head_dim, 0.f), vf(block_size * head_dim),
        scores(padded_block * lanes), acc(lanes * head_dim), mx(lanes), sum(lanes);
    const bool in_order = order.empty();
    const int64_t first = in_order ? first_worker * share : claim();
    const int64_t stop = in_order ? std::min(tasks, end_worker * share) : tasks;
    for (int64_t claimed = first; claimed < stop; claimed = in_order ? claimed + 1 : claim()) {
      const int64_t task = in_order ? claimed : order[claimed];
      const int64_t s = task / (kv_heads * splits), h = task / splits % kv_heads, run = task % splits;
      const int64_t len = pr.lens[s];
      const auto [b_begin, b_end] = blocks_of(task);
      std::fill(qt.begin(), qt.end(), 0.f);  // [lane chunk][dim][lane]
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          qt[((g / kLanes) * head_dim + i) * kLanes + g % kLanes] =
              to_f32(q[(s * heads + h * group + g) * head_dim + i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);  // [lane][dim], not yet divided by the sums
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t p0 = b * block_size, n = std::min(block_size, len - p0);
        for (int64_t ahead = b == b_begin ? 1 : kBlocksAhead; ahead <= kBlocksAhead; ++ahead)
          if (b + ahead < b_end) pr.prefetch_block(s, b + ahead, h);
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
        const int64_t head = s * heads + h * group + g;
        if (splits > 1) {
          std::memcpy(run_acc.data() + (head * splits + run) * head_dim, acc.data() + g * head_dim,
                      head_dim * sizeof(float));
          run_mx[head * splits + run] = mx[g];
          run_sum[head * splits + run] = sum[g];
          continue;
        }
        const float inv = 1.f / sum[g];
        for (int64_t i = 0; i < head_dim; ++i) pr.out[head * head_dim + i] = from_f32<T>(acc[g * head_dim + i] * inv);
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
  const int32_t* lp = lc.data_ptr<int32_t>();
  const int64_t longest = D > 0 ? *std::max_element(lp, lp + D) : 0;
  const int64_t splits = context_splits(D * kv_heads, at::get_num_threads(), longest);
  QB_DISPATCH(q.scalar_type(), "paged_decode_attention",
              decode_attention_f32(Problem<scalar_t>{qc.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                                                     kv_cache.data_ptr<scalar_t>() + half, tables.data_ptr<int32_t>(),
                                                     lc.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), D, heads,
                                                     kv_heads, head_dim, block_size, tables.size(1),
                                                     static_cast<float>(scale)},
                                   splits));
  return out;
}
