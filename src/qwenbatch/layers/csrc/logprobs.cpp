// Log-probabilities of the model's raw distribution, as an OpenAI `logprobs` / `top_logprobs` request returns them
// and vLLM's `prompt_logprobs` (each prompt token's logprob, its rank and the k best at its position): per row, one
// token's log-probability and rank, and the k largest logits. The sampler's PyTorch path takes a log-softmax of
// every row (a float32 copy of [rows, 151,936]) and a top-k over it: 54 ms a step at 64 rows on a 2-core CPU, more
// than half of the model's own step; a rank by comparing the row with the token's logit in PyTorch took 51 ms a
// 256-row chunk of a scored prompt, five times this kernel. Here a row is read three times (its maximum and the
// logits above the token's, the sum of exp(logit - maximum), and the top-k search), in its own dtype, and nothing
// row-sized is written.
#include "float_math.h"
#include "ops.h"
#include "row_search.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The log-sum-exp is summed in float32 within blocks of this many logits, the blocks in double. GCC adds each
// block's vector lanes one after another at its end: blocks of 1,024 rather than 256 ran a 64-row call of k = 5
// 1.05-1.08x faster (BENCHMARKS.md, "Temperature-only rows in two passes"); a lane holds 64 float32 terms a block.
constexpr int64_t kBlock = 1024;

template <typename T>
void row_logprobs(const T* x, int64_t vocab, int64_t target, int64_t k, float& target_logprob, int64_t& rank,
                  float* values, int64_t* ids) {
  const float mine = qb::to_f32(x[target]);
  float top = -std::numeric_limits<float>::infinity();
  int64_t above = 0;
#pragma omp simd reduction(max : top) reduction(+ : above)
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = qb::to_f32(x[i]);
    top = qb::max_of(top, v);
    above += v > mine;
  }
  rank = above + 1;
  float lse;
  if (std::isfinite(top)) {
    double sum = 0.0;  // over blocks of float32 sums: within ~1e-6 of the exact sum, as torch's logsumexp
    for (int64_t block = 0; block < vocab; block += kBlock) {
      const int64_t end = std::min(vocab, block + kBlock);
      float part = 0.f;
#pragma omp simd reduction(+ : part)
      for (int64_t i = block; i < end; ++i) {
        const float v = qb::to_f32(x[i]);
        part += v == -std::numeric_limits<float>::infinity() ? 0.f : qb::vec_exp(v - top);
      }
      sum += part;
    }
    lse = static_cast<float>(top + std::log(sum));  // sum >= 1: the maximum's own term
  } else {
    lse = std::numeric_limits<float>::quiet_NaN();  // an inf, a NaN or no finite logit: the request fails anyway
  }
  target_logprob = mine - lse;
  if (k == 0) return;

  qb::TopK best(k);  // the first k enter whatever they are (-inf too)
  qb::select_top_k(x, vocab, best);
  int64_t j = 0;
  for (const auto& [v, id] : best.best()) {
    values[j] = v - lse;
    ids[j++] = id;
  }
  for (; j < k; ++j) {  // a vocabulary smaller than k
    values[j] = -std::numeric_limits<float>::infinity();
    ids[j] = 0;
  }
}

}  // namespace

// logits: [R, vocab] float32, bfloat16 or float16; targets: int64 [R], one token a row; k >= 0. Returns each target's
// log-probability (float32 [R]) and rank (int64 [R]: 1 + how many logits of its row are larger), and each row's k
// largest logits as log-probabilities (float32 [R, k], best first, ties by the lower id) with their ids (int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits,
                                                                          const at::Tensor& targets,
                                                                          int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "token_logprobs: logits must be [rows, vocab]");
  TORCH_CHECK(k >= 0, "token_logprobs: k must be >= 0");
  const at::Tensor x = logits.contiguous(), wanted = targets.to(at::kLong).contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(wanted.dim() == 1 && wanted.size(0) == rows, "token_logprobs: targets must be [rows]");
  const int64_t* target = wanted.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(target[r] >= 0 && target[r] < vocab, "token_logprobs: a target lies outside the vocabulary");
  at::Tensor chosen = at::empty({rows}, at::kFloat), ranks = at::empty({rows}, at::kLong),
             values = at::empty({rows, k}, at::kFloat), ids = at::empty({rows, k}, at::kLong);
  float* chosen_out = chosen.data_ptr<float>();
  int64_t* ranks_out = ranks.data_ptr<int64_t>();
  float* values_out = values.data_ptr<float>();
  int64_t* ids_out = ids.data_ptr<int64_t>();
  QB_DISPATCH(x.scalar_type(), "token_logprobs", {
    const scalar_t* in = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        row_logprobs(in + r * vocab, vocab, target[r], k, chosen_out[r], ranks_out[r], values_out + r * k,
                     ids_out + r * k);
    });
  });
  return {chosen, ranks, values, ids};
}
