// Sampling one token per row: temperature, top-k, top-p and min-p, then a draw by the inverse of the distribution's
// CDF, from one uniform number a row; or, at temperature 0, the argmax. Penalties and suppressed tokens come as ids
// (RowPenalties in layers/sampler.py): the logits at the prompt's ids scaled by the repetition penalty, those at the
// output's ids given their penalised values, the suppressed ones -inf, as the PyTorch path's LogitEdits. The
// sampler's PyTorch path (layers/sampler.py) sorts each row of 151,936 logits for top-k / top-p; before this kernel
// (and with an exponential race for the draw: 151,936 random numbers a row) it took 276 ms (temperature only) to
// 654 ms (top-p) a step at 64 rows on a 2-core CPU, several times the model's own step. Here a row takes a few vector
// passes over its logits; the kept set and the draw are the PyTorch path's:
// - y = logit / temperature; tokens ranked by y, ties by the lower id (a stable descending sort);
// - top-k keeps the first k of that ranking; top-p then keeps a token while the mass ranked before it is below
//   top_p (of the top-k's mass); min-p drops a kept token whose weight is below min_p times the best one's;
// - the draw is the first id, in vocabulary order, whose kept weights up to and including it exceed u times
//   their total;
// - at temperature 0, the first id holding the largest logit (as argmax).
// A row that temperature and min-p alone shape ranks nothing: its weights are exp((logit - largest) / temperature)
// in two passes, multiplied by 1 / temperature rather than divided (sample_by_temperature).
// The cuts come from buckets of the weights by their float bits (monotone in the weight): the bucket a cut falls in
// is found by bisection, each step counting (top-k) or summing (top-p) the weights at or above a bucket in one
// vector pass, so that only the buckets at and above the cut (top-k) or the one bucket it falls in (top-p) are
// sorted. A small top-k (Qwen's generation config asks for 20) is selected directly, and only its weights taken;
// top-p alone first looks for its cut among the 64 best tokens, selected the same way, and bisects only where they
// hold less than top_p of the mass.
#include "float_math.h"
#include "ops.h"
#include "row_search.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A weight's bucket: its float bits' top 12 (sign, exponent, 3 bits of mantissa); weights lie in [0, 1].
constexpr int kBucketShift = 20;
constexpr int kBuckets = 1 << (32 - kBucketShift);
constexpr int kTopBucket = 0x3F800000 >> kBucketShift;  // 1.0f's: the best token's weight
// rank_buckets compares blocks of this many weights with the buckets' bounds as vectors.
constexpr int64_t kBlock = 256;
// The draw's blocks: each block's kept weight summed (float32, vectorized), then the block the draw falls in searched.
// GCC adds the lanes of each block's vector sum one after another at its end: at 256 values a block, a quarter of a
// temperature-only row's time (BENCHMARKS.md, "Temperature-only rows in two passes").
constexpr int64_t kDrawBlock = 1024;
// A top-k up to this many is found by qb::select_top_k (its cost grows with k), a larger one by bisection.
constexpr int64_t kSmallTopK = 64;
// Top-p alone first ranks this many of the best tokens, and cuts the rest by bisection only where their mass falls
// short.
constexpr int64_t kNucleusCandidates = 64;

struct RowParams {
  float temperature, top_p, min_p;  // temperature 0: the argmax
  int64_t top_k;                    // 0: off
  double u;                         // in [0, 1)
  // The row's penalties: the logits at prompt_ids (the prompt's distinct ids) scaled by `repetition`; then those at
  // output_ids (the output's, each as often as generated) scaled by it from the row's own logit, less frequency *
  // count + presence; then those at suppressed_ids -inf.
  float repetition;
  double presence, frequency;
  const int64_t* prompt_ids;
  int64_t prompts;
  const int64_t* output_ids;
  int64_t outputs;
  const int64_t* suppressed_ids;
  int64_t suppressed;
};

// A candidate of the ranking: its scaled logit, id and weight.
struct Ranked {
  float y;
  int64_t id;
  float w;
};

// Ranked first: the larger y, then the lower id.
bool ranks_before(const Ranked& a, const Ranked& b) { return a.y > b.y || (a.y == b.y && a.id < b.id); }

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// How many tokens weigh at or above a bucket's least weight.
int64_t count_at_or_above(const float* w, int64_t vocab, int bucket) {
  const uint32_t low = static_cast<uint32_t>(bucket) << kBucketShift;
  int32_t count = 0;  // 32-bit lanes: twice as many a vector as int64_t's
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < vocab; ++i) count += bits_of(w[i]) >= low;
  return count;
}

// The summed weight of the tokens at or above a bucket's least weight.
double mass_at_or_above(const float* w, int64_t vocab, int bucket) {
  const uint32_t low = static_cast<uint32_t>(bucket) << kBucketShift;
  return qb::lane_sum(vocab, [&](int64_t i) { return bits_of(w[i]) >= low ? w[i] : 0.f; });
}

// The highest bucket whose tokens, with all those above it, measure `enough`, by bisection over the buckets (each
// step one vector pass over the weights: a histogram's scattered adds, one a token, took ~0.3 ms a row of 151,936,
// most of them into the same few buckets); `above` gets the measure of the tokens above it.
template <typename Measure, typename Enough, typename Value>
int cut_bucket(Measure measure, Enough enough, Value& above) {
  int low = 0, high = kTopBucket + 1;  // enough at low, not at high
  above = Value{};
  while (high - low > 1) {
    const int mid = (low + high) / 2;
    const Value at_mid = measure(mid);
    if (enough(at_mid)) {
      low = mid;
    } else {
      high = mid;
      above = at_mid;
    }
  }
  return low;
}

// A row's scratch, reused across the rows a thread samples.
struct Scratch {
  std::vector<float> y, w;
  std::vector<double> block_mass;
  std::vector<Ranked> ranked;
  std::vector<int64_t> ids;

  explicit Scratch(int64_t vocab) : y(vocab), w(vocab), block_mass((vocab + kDrawBlock - 1) / kDrawBlock) {}
};

// How many of `ranked` (sorted by ranks_before) top-p keeps: a token is dropped, and all after it, once the mass
// ranked before it (`before`, plus the ones before it in `ranked`) reaches `target`.
size_t top_p_keeps(const std::vector<Ranked>& ranked, double before, double target) {
  size_t kept = 0;
  for (const Ranked& r : ranked) {
    if (before >= target) break;
    before += r.w;
    ++kept;
  }
  return kept;
}

// The summed weight of `ranked`.
double mass_of(const std::vector<Ranked>& ranked) {
  double mass = 0.0;
  for (const Ranked& r : ranked) mass += r.w;
  return mass;
}

// How many of a top-k's `ranked` tokens top-p keeps: it cuts them by their own mass.
size_t top_p_of_top_k(const std::vector<Ranked>& ranked, float top_p) {
  return top_p < 1.f ? top_p_keeps(ranked, 0.0, top_p * mass_of(ranked)) : ranked.size();
}

// Zeroes the weights of the tokens top-k or top-p drop, from the ranked candidates they keep: every token at or above
// `above` (the buckets above the cut: top-p alone) and the first `kept` of `ranked`.
void keep_only(float* w, int64_t vocab, float above, const std::vector<Ranked>& ranked, size_t kept) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] >= above ? w[i] : 0.f;
  for (size_t j = 0; j < kept; ++j) w[ranked[j].id] = ranked[j].w;
}

// The tokens of buckets `from` to `to`, ranked (sorted by ranks_before). Blocks of weights are compared with the
// buckets' bounds as vectors; only a block holding such a token is looked at one token at a time.
void rank_buckets(const float* y, const float* w, int64_t vocab, int from, int to, std::vector<Ranked>& ranked) {
  ranked.clear();
  const uint32_t first = static_cast<uint32_t>(from) << kBucketShift;
  const uint32_t last = static_cast<uint32_t>((static_cast<uint64_t>(to + 1) << kBucketShift) - 1);
  for (int64_t block = 0; block < vocab; block += kBlock) {
    const int64_t end = std::min(vocab, block + kBlock);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = block; i < end; ++i) hit |= (bits_of(w[i]) >= first) & (bits_of(w[i]) <= last);
    if (!hit) continue;
    for (int64_t i = block; i < end; ++i) {
      const int b = static_cast<int>(bits_of(w[i]) >> kBucketShift);
      if (b >= from && b <= to) ranked.push_back({y[i], i, w[i]});
    }
  }
  std::sort(ranked.begin(), ranked.end(), ranks_before);
}

// The smallest weight of the buckets above `bucket`.
float bucket_end(int bucket) {
  if (bucket + 1 >= kBuckets) return std::numeric_limits<float>::infinity();
  const uint32_t bits = static_cast<uint32_t>(bucket + 1) << kBucketShift;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Draws from `ranked` (sorted by ranks_before, each with its weight), of which top-k and top-p keep the first
// `kept`: min-p drops a kept token whose weight is below min_p times the best one's (1), and the draw is made in
// vocabulary order as below.
int64_t draw_from_ranked(std::vector<Ranked>& ranked, size_t kept, const RowParams& p) {
  ranked.resize(kept);
  const float min_w = p.min_p;
  ranked.erase(std::remove_if(ranked.begin(), ranked.end(),
                              [min_w](const Ranked& r) { return !(r.w >= min_w && r.w > 0.f); }),
               ranked.end());
  if (ranked.empty()) return 0;
  std::sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) { return a.id < b.id; });
  double total = 0.0;
  for (const Ranked& r : ranked) total += r.w;
  const double target = p.u * total;
  double running = 0.0;
  for (const Ranked& r : ranked) {
    running += r.w;
    if (running > target) return r.id;
  }
  return ranked.back().id;  // u * total past the sum by rounding: the last kept token
}

// The k best tokens of y, ranked, with their weights: blocks of y compared with the k-th best as vectors.
void rank_best(const float* y, int64_t vocab, int64_t k, float top, std::vector<Ranked>& ranked) {
  qb::TopK best(k);
  qb::select_top_k(y, vocab, best);
  ranked.clear();
  for (const auto& [v, id] : best.best()) ranked.push_back({v, id, v == kNegInf ? 0.f : qb::vec_exp(v - top)});
}

// Each token's weight into w, and their sum.
double weigh(const float* y, float* w, int64_t vocab, float top) {
  return qb::lane_sum(vocab, [&](int64_t i) { return w[i] = y[i] == kNegInf ? 0.f : qb::vec_exp(y[i] - top); });
}

// frequency * count + presence with each operation rounded, as the PyTorch path computes it: not fused into one
// FMA, as GCC does by default in C++ (a different float32 value wherever the sum lies halfway between two).
__attribute__((optimize("fp-contract=off"))) double penalty(double frequency, size_t count, double presence) {
  return frequency * static_cast<double>(count) + presence;
}

// y at the output's distinct ids: each one's logit scaled by the repetition penalty (divided where positive,
// multiplied where not), less frequency * count + presence (in double, rounded to float32), over the temperature;
// the same float32 operations as LogitEdits in layers/sampler.py. `ids` is scratch.
template <typename T>
void penalise_output(const T* logits, const RowParams& p, float temperature, std::vector<int64_t>& ids, float* y) {
  ids.assign(p.output_ids, p.output_ids + p.outputs);
  std::sort(ids.begin(), ids.end());
  for (size_t first = 0, end = 0; first < ids.size(); first = end) {
    while (end < ids.size() && ids[end] == ids[first]) ++end;
    const float x = qb::to_f32(logits[ids[first]]);
    const float scaled = x > 0.f ? x / p.repetition : x * p.repetition;
    y[ids[first]] = (scaled - static_cast<float>(penalty(p.frequency, end - first, p.presence))) / temperature;
  }
}

// Stores w[i] = weight(i) for every token and each block of kDrawBlock weights' sum in block_mass; their total.
template <typename F>
__attribute__((always_inline)) inline double store_and_sum_blocks(float* w, int64_t vocab, double* block_mass,
                                                                  F weight) {
  double total = 0.0;
  for (int64_t b = 0, begin = 0; begin < vocab; ++b, begin += kDrawBlock) {
    const int64_t end = std::min(vocab, begin + kDrawBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = begin; i < end; ++i) sum += w[i] = weight(i);
    block_mass[b] = sum;
    total += sum;
  }
  return total;
}

// The first id, in vocabulary order, whose weights w up to and including it exceed u times their total: the block
// whose running total passes it, then the token in it. block_mass holds each block of kDrawBlock weights' sum.
int64_t draw_by_blocks(const float* w, int64_t vocab, const double* block_mass, double total, double u) {
  if (!(total > 0.0)) return 0;
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  const double target = u * total;
  double running = 0.0;
  int64_t last_kept = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + block_mass[b] <= target && b + 1 < blocks) {
      running += block_mass[b];
      continue;
    }
    const int64_t begin = b * kDrawBlock, end = std::min(vocab, begin + kDrawBlock);
    for (int64_t i = begin; i < end; ++i) {
      if (w[i] <= 0.f) continue;
      last_kept = i;
      running += w[i];
      if (running > target) return i;
    }
  }
  return last_kept;  // u * total past the sum by rounding: the last kept token
}

// Whether temperature (and min-p) alone shape the row: no penalty, top-k or top-p, and a temperature above 0.
bool shaped_by_temperature_alone(const RowParams& p, int64_t vocab) {
  return p.temperature > 0.f && p.prompts == 0 && p.outputs == 0 && p.suppressed == 0 && p.top_p >= 1.f &&
         !(p.top_k > 0 && p.top_k < vocab);
}

// A row that temperature and min-p alone shape, in two passes: the largest logit, then each token's weight
// exp((x - top) / temperature) cut by min-p and summed by blocks. Nothing is ranked, so no scaled logit is kept, and
// the weight multiplies by 1 / temperature where the general path divides each logit (the division alone took 11% of
// a 64-row call): a weight may differ from the PyTorch path's in its last bit, as vec_exp's already do.
template <typename T>
int64_t sample_by_temperature(const T* logits, int64_t vocab, const RowParams& p, Scratch& s, bool& non_finite) {
  float top = kNegInf, poison = 0.f;  // poison: NaN where a logit is an inf or a NaN (inf * 0)
#pragma omp simd reduction(max : top) reduction(+ : poison)
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = qb::to_f32(logits[i]);
    poison += x * 0.f;
    top = qb::max_of(top, x);
  }
  non_finite = !(poison == 0.f);
  if (!std::isfinite(top)) return 0;  // an inf, or every logit -inf
  float* w = s.w.data();
  const float scale = 1.f / p.temperature, min_w = p.min_p;
  const double total = store_and_sum_blocks(w, vocab, s.block_mass.data(), [&](int64_t i) {
    const float x = qb::to_f32(logits[i]);
    const float weight = x == kNegInf ? 0.f : qb::vec_exp((x - top) * scale);
    return weight >= min_w ? weight : 0.f;
  });
  return draw_by_blocks(w, vocab, s.block_mass.data(), total, p.u);
}

// Row `logits` (any float dtype) sampled as the file's header says; `non_finite` set where the row itself (not its
// penalties) holds an inf or a NaN.
template <typename T>
int64_t sample_row(const T* logits, int64_t vocab, const RowParams& p, Scratch& s, bool& non_finite) {
  if (shaped_by_temperature_alone(p, vocab)) return sample_by_temperature(logits, vocab, p, s, non_finite);
  float* y = s.y.data();
  float* w = s.w.data();
  float top = kNegInf, poison = 0.f;  // poison: NaN where a logit is an inf or a NaN (inf * 0)
  const float temperature = p.temperature > 0.f ? p.temperature : 1.f;
#pragma omp simd reduction(max : top) reduction(+ : poison)
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = qb::to_f32(logits[i]);
    poison += x * 0.f;
    y[i] = x / temperature;  // a division, as the PyTorch path's: the same values, so the same ranking
    top = qb::max_of(top, y[i]);
  }
  non_finite = !(poison == 0.f);
  if (p.prompts > 0 || p.outputs > 0 || p.suppressed > 0) {  // -inf here is a suppressed token: the row still samples
    for (int64_t j = 0; j < p.prompts; ++j) {
      const float x = qb::to_f32(logits[p.prompt_ids[j]]);
      y[p.prompt_ids[j]] = (x > 0.f ? x / p.repetition : x * p.repetition) / temperature;
    }
    penalise_output(logits, p, temperature, s.ids, y);
    for (int64_t j = 0; j < p.suppressed; ++j) y[p.suppressed_ids[j]] = kNegInf;
    top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < vocab; ++i) top = qb::max_of(top, y[i]);
  }
  if (!std::isfinite(top)) return 0;  // an inf, or every logit -inf
  if (p.temperature <= 0.f) return qb::first_index_of(y, vocab, top);
  if (p.top_k > 0 && p.top_k <= kSmallTopK && p.top_k < vocab) {
    // A small top-k: its k best only, and their weights; top-p cuts them by their own mass.
    rank_best(y, vocab, p.top_k, top, s.ranked);
    return draw_from_ranked(s.ranked, top_p_of_top_k(s.ranked, p.top_p), p);
  }
  const bool top_p_alone = p.top_p < 1.f && !(p.top_k > 0 && p.top_k < vocab);
  double row_mass = 0.0;  // every token's weight summed: top-p alone
  if (top_p_alone) {
    // Top-p keeps few tokens of a model's rows (at temperature 0.7 and top_p 0.95, at most 52 of the default
    // model's over 32 chat prompts; at temperature 1, 95% of rows within 64): where the nucleus candidates' mass
    // reaches top_p of the row's, the cut falls among them and the other tokens are never looked at.
    row_mass = weigh(y, w, vocab, top);
    rank_best(y, vocab, kNucleusCandidates, top, s.ranked);
    const double target = p.top_p * row_mass;
    if (mass_of(s.ranked) >= target) return draw_from_ranked(s.ranked, top_p_keeps(s.ranked, 0.0, target), p);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) w[i] = y[i] == kNegInf ? 0.f : qb::vec_exp(y[i] - top);
  }

  if (p.top_k > 0 && p.top_k < vocab) {
    // The buckets from the top down to the one holding the k-th best token; their tokens ranked, the first k kept.
    int64_t above = 0;
    const int bucket = cut_bucket([&](int b) { return count_at_or_above(w, vocab, b); },
                                  [&](int64_t count) { return count >= p.top_k; }, above);
    rank_buckets(y, w, vocab, bucket, kBuckets - 1, s.ranked);
    s.ranked.resize(std::min<size_t>(s.ranked.size(), p.top_k));
    keep_only(w, vocab, std::numeric_limits<float>::infinity(), s.ranked, top_p_of_top_k(s.ranked, p.top_p));
  } else if (top_p_alone) {
    // The cut falls in the highest bucket whose mass, with all above it, reaches top_p of the total: the buckets
    // above it are kept whole, its tokens ranked, those below dropped.
    const double target = p.top_p * row_mass;
    double above = 0.0;
    const int bucket = cut_bucket([&](int b) { return mass_at_or_above(w, vocab, b); },
                                  [&](double mass) { return mass >= target; }, above);
    rank_buckets(y, w, vocab, bucket, bucket, s.ranked);
    keep_only(w, vocab, bucket_end(bucket), s.ranked, top_p_keeps(s.ranked, above, target));
  }

  // min-p (the best token's weight is exp(0) = 1); the kept weights summed in blocks; then the draw.
  const float min_w = p.min_p;
  const double total = store_and_sum_blocks(w, vocab, s.block_mass.data(), [&](int64_t i) {
    return w[i] >= min_w ? w[i] : 0.f;
  });
  return draw_by_blocks(w, vocab, s.block_mass.data(), total, p.u);
}

// Every row's settings and penalties: row r's prompt ids are prompt_ids [prompt_starts[r],
// prompt_starts[r + 1]), and its output and suppressed ids the same way.
struct Settings {
  const float *temperature, *top_p, *min_p, *repetition;
  const double *presence, *frequency;
  const int64_t* top_k;
  const double* uniform;
  const int64_t *prompt_starts, *prompt_ids, *output_starts, *output_ids, *suppressed_starts, *suppressed_ids;

  RowParams row(int64_t r) const {
    const int64_t prompt = prompt_starts[r], output = output_starts[r], suppressed = suppressed_starts[r];
    return {temperature[r],
            top_p[r],
            min_p[r],
            top_k[r],
            uniform[r],
            repetition[r],
            presence[r],
            frequency[r],
            prompt_ids + prompt,
            prompt_starts[r + 1] - prompt,
            output_ids + output,
            output_starts[r + 1] - output,
            suppressed_ids + suppressed,
            suppressed_starts[r + 1] - suppressed};
  }
};

template <typename T>
void sample_rows(const T* logits, int64_t rows, int64_t vocab, const Settings& settings, int64_t* tokens,
                 bool* non_finite) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch(vocab);
    for (int64_t r = r0; r < r1; ++r)
      tokens[r] = sample_row(logits + r * vocab, vocab, settings.row(r), scratch, non_finite[r]);
  });
}

}  // namespace

namespace {

// A list of ids cut into rows: `starts` int64 [rows + 1] from 0 to the ids' count, not decreasing; each id < vocab.
void check_rows_of_ids(const at::Tensor& starts, const at::Tensor& ids, int64_t rows, int64_t vocab,
                       const char* name) {
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == rows + 1 && starts.scalar_type() == at::kLong &&
                  starts.is_contiguous() && ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "sample_tokens: ", name, " must be contiguous int64 starts [rows + 1] and ids");
  const int64_t* s = starts.data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0 && s[rows] == ids.size(0), "sample_tokens: ", name, " must start at 0, end at the count");
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(s[r] <= s[r + 1], "sample_tokens: ", name, " starts decrease");
  TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab),
              "sample_tokens: an id of ", name, " lies outside the vocabulary");
}

}  // namespace

// logits: [R, vocab] float32, bfloat16 or float16; temperature (>= 0; 0: the argmax), top_p, min_p, repetition:
// float32 [R]; presence, frequency: float64 [R]; top_k: int64 [R] (0: off); uniform: float64 [R] in [0, 1);
// prompt_starts / prompt_ids, output_starts / output_ids and suppressed_starts / suppressed_ids (int64): the
// penalties' ids, cut into rows as RowPenalties says. Returns each row's token (int64 [R]) and whether the row held
// an inf or a NaN (bool [R]).
std::tuple<at::Tensor, at::Tensor> sample_tokens(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform,
    const at::Tensor& repetition, const at::Tensor& presence, const at::Tensor& frequency,
    const at::Tensor& prompt_starts, const at::Tensor& prompt_ids, const at::Tensor& output_starts,
    const at::Tensor& output_ids, const at::Tensor& suppressed_starts, const at::Tensor& suppressed_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "sample_tokens: logits must be [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto check = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type, "sample_tokens: ", name,
                " must be one value a row of type ", type);
    return t.contiguous();
  };
  const at::Tensor x = logits.contiguous(), t = check(temperature, at::kFloat, "temperature"),
                   k = check(top_k, at::kLong, "top_k"), tp = check(top_p, at::kFloat, "top_p"),
                   mp = check(min_p, at::kFloat, "min_p"), u = check(uniform, at::kDouble, "uniform"),
                   rp = check(repetition, at::kFloat, "repetition"),
                   pp = check(presence, at::kDouble, "presence"),
                   fp = check(frequency, at::kDouble, "frequency");
  check_rows_of_ids(prompt_starts, prompt_ids, rows, vocab, "prompt_ids");
  check_rows_of_ids(output_starts, output_ids, rows, vocab, "output_ids");
  check_rows_of_ids(suppressed_starts, suppressed_ids, rows, vocab, "suppressed_ids");
  const Settings settings{t.data_ptr<float>(),
                          tp.data_ptr<float>(),
                          mp.data_ptr<float>(),
                          rp.data_ptr<float>(),
                          pp.data_ptr<double>(),
                          fp.data_ptr<double>(),
                          k.data_ptr<int64_t>(),
                          u.data_ptr<double>(),
                          prompt_starts.data_ptr<int64_t>(),
                          prompt_ids.data_ptr<int64_t>(),
                          output_starts.data_ptr<int64_t>(),
                          output_ids.data_ptr<int64_t>(),
                          suppressed_starts.data_ptr<int64_t>(),
                          suppressed_ids.data_ptr<int64_t>()};
  at::Tensor tokens = at::empty({rows}, at::kLong), non_finite = at::empty({rows}, at::kBool);
  QB_DISPATCH(x.scalar_type(), "sample_tokens",
              sample_rows(x.data_ptr<scalar_t>(), rows, vocab, settings, tokens.data_ptr<int64_t>(),
                          non_finite.data_ptr<bool>()));
  return {tokens, non_finite};
}
