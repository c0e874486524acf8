// Searches over a row of logits, in blocks compared as vectors: the first index holding a value (the greedy and
// sampling kernels' argmax), and the k largest values, best first, ties by the lower index (the logprobs kernel's
// token_logprobs, the sampling kernel's top-k and its top-p candidates, where k is small next to the vocabulary: 20
// in Qwen's generation config, at most 20 for an OpenAI top_logprobs, 64 candidates).
#pragma once
#include "float_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace qb {

constexpr int64_t kSearchBlock = 256;

// The first index of x[0, n) holding `value` (read as float32), or 0 where none does. Blocks are compared with it as
// vectors and only the block that holds it is looked at one value at a time. (One value at a time from the row's
// start took 2.4 ms at 64 rows of the default model's vocabulary, 9.6 at 256, against 0.6 and 2.3 for the maximum
// alone: a quarter of the LM head's time there, AMX kind.)
template <typename T>
int64_t first_index_of(const T* x, int64_t n, float value) {
  for (int64_t block = 0; block < n; block += kSearchBlock) {
    const int64_t end = std::min(n, block + kSearchBlock);
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int64_t i = block; i < end; ++i) found |= to_f32(x[i]) == value;
    if (found) {
      while (to_f32(x[block]) != value) ++block;
      return block;
    }
  }
  return 0;
}

// The k largest values offered so far, best first; ties keep the lower index first (indices must be offered in
// increasing order).
class TopK {
 public:
  explicit TopK(int64_t k) : k_(k) { best_.reserve(k + 1); }

  // What a value must exceed to enter: -inf until k values are held (a -inf enters only while fewer are).
  float threshold() const { return full() ? best_.back().first : -std::numeric_limits<float>::infinity(); }
  bool full() const { return static_cast<int64_t>(best_.size()) == k_; }

  void offer(float v, int64_t index) {
    if (full() && !(v > best_.back().first)) return;
    auto at = std::find_if(best_.begin(), best_.end(), [v](const auto& e) { return e.first < v; });
    best_.insert(at, {v, index});
    if (static_cast<int64_t>(best_.size()) > k_) best_.pop_back();
  }

  // (value, index) pairs, best first: at most k.
  const std::vector<std::pair<float, int64_t>>& best() const { return best_; }

 private:
  int64_t k_;
  std::vector<std::pair<float, int64_t>> best_;
};

// Whether any of x[begin, end) exceeds `threshold`.
template <typename T>
__attribute__((always_inline)) inline bool any_above(const T* x, int64_t begin, int64_t end, float threshold) {
  int better = 0;
#pragma omp simd reduction(| : better)
  for (int64_t i = begin; i < end; ++i) better |= to_f32(x[i]) > threshold;
  return better;
}

// The k largest of x[0, n) (read as float32) into `best`. Blocks of x are compared with the k-th best as vectors,
// and a block that holds a better one is compared again a vector at a time: only such a vector is looked at one
// value at a time (~k ln(n / k) values enter in all on random rows: at k = 64 over 151,936 floats, 50 us against 65
// with whole blocks looked at, AMX kind).
template <typename T>
void select_top_k(const T* x, int64_t n, TopK& best) {
  constexpr int64_t kVector = 16;
  for (int64_t block = 0; block < n; block += kSearchBlock) {
    const int64_t end = std::min(n, block + kSearchBlock);
    if (best.full() && !any_above(x, block, end, best.threshold())) continue;
    for (int64_t part = block; part < end; part += kVector) {
      const int64_t part_end = std::min(end, part + kVector);
      if (best.full() && !any_above(x, part, part_end, best.threshold())) continue;
      for (int64_t i = part; i < part_end; ++i) best.offer(to_f32(x[i]), i);
    }
  }
}

}  // namespace qb
