// Log-probabilities of the model's raw distribution, as an OpenAI `logprobs` / `top_logprobs` request returns them:
// each row's log-sum-exp and its k largest logits. The sampler's PyTorch path takes a log-softmax of every row (a
// float32 copy of [rows, 151,936]) and a top-k over it: 54 ms a step at 64 rows on a 2-core CPU, more than half of
// the model's own step. Here a row is read three times (its maximum, the sum of exp(logit - maximum), and the top-k
// search), in its own dtype, and nothing row-sized is written.
#include "float_math.h"
#include "ops.h"
#include "row_search.h"

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
void row_logprobs(const T* x, int64_t vocab, int64_t k, float& lse, float* values, int64_t* ids) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) top = qb::max_of(top, qb::to_f32(x[i]));
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

// logits: [R, vocab] float32, bfloat16 or float16; k >= 0. Returns each row's log-sum-exp (float32 [R]) and its k
// largest logits as log-probabilities (float32 [R, k], best first, ties by the lower id) with their ids (int64).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> top_logprobs(const torch::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "top_logprobs: logits must be [rows, vocab]");
  TORCH_CHECK(k >= 0, "top_logprobs: k must be >= 0");
  const torch::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  torch::Tensor lse = torch::empty({rows}, torch::kFloat32), values = torch::empty({rows, k}, torch::kFloat32),
                ids = torch::empty({rows, k}, torch::kInt64);
  float* lse_out = lse.data_ptr<float>();
  float* values_out = values.data_ptr<float>();
  int64_t* ids_out = ids.data_ptr<int64_t>();
  QB_DISPATCH(x.scalar_type(), "top_logprobs", {
    const scalar_t* in = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        row_logprobs(in + r * vocab, vocab, k, lse_out[r], values_out + r * k, ids_out + r * k);
    });
  });
  return {lse, values, ids};
}
