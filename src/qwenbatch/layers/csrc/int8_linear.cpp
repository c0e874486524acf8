// Int8 linear for CPU: int8 weights, activations quantized on the fly, integer dot products.
//
// y[M, N] = x[M, K] . W[N, K]^T + b, where W = q * s: int8 q with one scale per 32 consecutive weights of a
// row (GGUF's Q8_0 / Q5_0 granularity), and x is quantized the same way for each call (one scale per 32
// values of a row, as llama.cpp does for its Q8_0 dot products). Each group's dot product is exact in
// int32; the float epilogue multiplies it by the two scales.
//
// Packed layout (made by layers/int8_linear.py): rows in tiles of 16; within a tile, for each 4 consecutive
// k, the 16 rows' 4 bytes side by side (64 bytes), stored as u = q + 128. One AVX-512 VNNI instruction then
// multiplies-adds 64 weights into 16 row sums: vpdpbusd(acc, u, x broadcast). Since u = q + 128,
// sum(u * x) = sum(q * x) + 128 * sum(x), and the second term, which depends on x only, is subtracted.
// Scales are float16, [tile][group][16 rows].
//
// With AVX2 only, the same products go through vpmaddubsw; elsewhere they run as plain loops.
//
// 5-bit weights (GGUF's Q5_0: q in [-16, 15]) are stored in 5/8 of the bytes and widened into the layout
// above as they are used. Per tile of 16 rows and group of 32 k (8 chunks of 4 k), 320 bytes: the low nibbles
// of u5 = q + 16, one 64-byte block per two consecutive chunks (the first in the low nibble), then the 8
// chunks' fifth bits, 64 bits little-endian each, bit b for byte b of the chunk: one stream of 10 * K bytes.
#include "bf16_vectors.h"
#include "float_math.h"
#include "int8_layout.h"
#include "int8_tasks.h"
#include "prefetch.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace qb;  // the layout (int8_layout.h), bf16 vectors (bf16_vectors.h)

constexpr int64_t kStreamRows = 8;  // up to this many rows of x, a linear streams its weights (decode steps)
constexpr int64_t kStreamAheadRows = 64;  // up to this many, widened 5-bit tiles prefetch the next ones' stream

// Four bytes of x as one int32, to be broadcast. Loaded 4 bytes at a time so that the compiler broadcasts
// straight from memory (a load, no vector ALU op); two chunks read as one 8-byte word went through a general
// register, a vmovd and a vpbroadcastd each: a quarter of the AVX2 kernel's vector ops (AVX2 kind, in-process
// A/B, benchmarks/kernel_ab.py: 8-bit layers 1.13-1.17x from 16 rows up, 5-bit 1.04x).
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The rows [begin, end) of x a task multiplies.
struct Rows {
  int64_t begin, end;
  int64_t count() const { return end - begin; }
};

struct QuantizedX {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, G]
  std::vector<int32_t> bias;  // [M, G]: 128 * sum of q over the group
};

// Where results go: rows [m, m + R) and columns [n, n + 16 * T) of T consecutive tiles, plus the bias, converted
// to the output's dtype; or, for a gated MLP's gate_up (`silu_and_mul`, each tile's rows 8 of the gate then the
// same 8 of up), SiLU(gate) * up into columns [n / 2, n / 2 + 8 * T), rounded as the unfused layer rounds (gate and
// up to the dtype, then as silu_and_mul does). Fused, the [M, N] intermediate is never written nor read back.
// A row block's tiles are stored together so that the conversions and the SiLU (an exp and a divide: a long chain
// of latencies) run R * 8 * T lanes wide. One tile of one row at a time, 8 lanes, cost gate_up 25% at 64 rows
// (AVX-512 BF16 kind, Zen 5).
struct Output {
  void* data;
  at::ScalarType type;  // float32, bfloat16 or float16
  int64_t ld;
  const float* bias;  // [N] or nullptr
  bool silu_and_mul;

  // v: [R][16 * T]. qb::from_f32 rounds as c10's conversion does, in code the compiler vectorizes.
  template <int R, int T, typename S>
  inline void store_as(int64_t m, int64_t n, const float* v) const {
    constexpr int kLanes = kTileRows * T;
    alignas(64) float biased[R][kLanes];
    for (int i = 0; i < R; ++i)
#pragma omp simd
      for (int r = 0; r < kLanes; ++r) biased[i][r] = v[i * kLanes + r] + (bias ? bias[n + r] : 0.f);
    if (!silu_and_mul) {
      for (int i = 0; i < R; ++i) {
        S* p = static_cast<S*>(data) + (m + i) * ld + n;
#pragma omp simd
        for (int r = 0; r < kLanes; ++r) p[r] = qb::from_f32<S>(biased[i][r]);
      }
      return;
    }
    constexpr int kHalf = kTileRows / 2, kOut = kLanes / 2;
    alignas(64) float gate[R * kOut], up[R * kOut];
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < kHalf; ++r) {
          gate[i * kOut + t * kHalf + r] = qb::to_f32(qb::from_f32<S>(biased[i][t * kTileRows + r]));
          up[i * kOut + t * kHalf + r] = qb::to_f32(qb::from_f32<S>(biased[i][t * kTileRows + kHalf + r]));
        }
    if constexpr (R == 1) {  // through a buffer, a decode step's single row ran 10% slower
      S* p = static_cast<S*>(data) + m * ld + n / 2;
#pragma omp simd
      for (int r = 0; r < kOut; ++r) p[r] = qb::silu_times<S>(gate[r], up[r]);
    } else {
      alignas(64) S result[R * kOut];
#pragma omp simd
      for (int r = 0; r < R * kOut; ++r) result[r] = qb::silu_times<S>(gate[r], up[r]);
      for (int i = 0; i < R; ++i)
        std::memcpy(static_cast<S*>(data) + (m + i) * ld + n / 2, result + i * kOut, sizeof(S) * kOut);
    }
  }

  template <int R = 1, int T = 1>
  inline void store(int64_t m, int64_t n, const float* v) const {
    switch (type) {
      case at::kBFloat16: store_as<R, T, c10::BFloat16>(m, n, v); break;
      case at::kHalf: store_as<R, T, c10::Half>(m, n, v); break;
      default: store_as<R, T, float>(m, n, v);
    }
  }
};

// One group of 32 values of x, quantized: q = round(x * 127 / max |x|) (to nearest even), the scale max |x| / 127,
// and sum(q). The SIMD versions compute exactly what the plain loop does; GCC left the plain loop's maximum and
// conversions partly scalar, and quantizing x was ~8% of an 8-bit down at 256 rows (AVX-512, perf).
struct QuantizedGroup {
  float scale;
  int32_t sum;
};

inline float inverse_of(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename T>
inline __m512 load16(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return load_bf16x16(x);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
}

template <typename T>
inline QuantizedGroup quantize_group(const T* x, int8_t* q) {
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(inverse_of(amax));
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  return {amax / 127.f, _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb))};
}
#elif defined(__AVX2__) && defined(__F16C__)
template <typename T>
inline __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return load_bf16x8(x);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
}

template <typename T>
inline QuantizedGroup quantize_group(const T* x, int8_t* q) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = load8(x + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
  m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(inverse_of(amax));
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // The packs interleave 128-bit lanes: bytes come out as 4-value runs of q0 q1 q2 q3 (low halves), then the high.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return {amax / 127.f, _mm_cvtsi128_si32(s4)};
}
#else
template <typename T>
inline QuantizedGroup quantize_group(const T* x, int8_t* q) {
  float xs[kGroup], amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) xs[i] = qb::to_f32(x[i]);
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xs[i]));
  const float inv = inverse_of(amax);
  int32_t sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(xs[i] * inv));
    sum += q[i];
  }
  return {amax / 127.f, sum};
}
#endif

template <typename T>
QuantizedX quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<int32_t>(M * G)};
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t mg = begin; mg < end; ++mg) {  // rows are contiguous, so (m, g) is group m * G + g of x
      const QuantizedGroup group = quantize_group(x + mg * kGroup, out.q.data() + mg * kGroup);
      out.scale[mg] = group.scale;
      out.bias[mg] = 128 * group.sum;
    }
  });
  return out;
}

constexpr int64_t kWidenTiles = 2;  // 5-bit tiles widened into a buffer at a time: 28 KB at K = 896

// The weight stream of the tiles widened next, asked into L2 a few lines at a time while a kernel works on the
// widened ones (`step` once per group of its loop): the widening pass alone kept memory and arithmetic serial.
// After a weight's last tiles the range runs past its end: a prefetch never faults, and asks for nothing useful.
struct StreamAhead {
  const uint8_t* next;
  const uint8_t* end;
  int64_t lines_per_step;

  StreamAhead(const uint8_t* begin, int64_t bytes, int64_t steps)
      : next(begin), end(begin + bytes), lines_per_step((bytes / 64 + steps - 1) / std::max<int64_t>(1, steps)) {}

  QB_ALWAYS_INLINE void step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += 64) qb::prefetch_l2(next);
  }
};

// Runs `kernel(weights, t, te, next, bytes)` on 5-bit tiles [t0, t1) from w, each widened by `widen(src, K, dst)`
// into `scratch` (kWidenTiles * 16 * K bytes) kWidenTiles at a time: once per call, then read by every row of x.
// [next, next + bytes) is the 5-bit stream widened after these: this task's next tiles, or the next task's first
// (a thread claims consecutive tasks), which the kernel may prefetch. Where rows are cut into blocks (more threads
// than tile runs: many-core machines), the next task is the same tiles' next block, and the stream asked for is the
// next run's, likely another thread's: wasted reads into L2, not wrong ones (unmeasured; no such machine here).
template <typename Kernel, typename Widen>
inline void widened_q5(const uint8_t* w, int64_t K, int64_t t0, int64_t t1, uint8_t* scratch, Kernel kernel,
                       Widen widen) {
  const int64_t tile_bytes = kTileRows * K * 5 / 8;
  for (int64_t t = t0; t < t1; t += kWidenTiles) {
    const int64_t te = std::min(t1, t + kWidenTiles);
    for (int64_t i = t; i < te; ++i) widen(w + (i - t0) * tile_bytes, K, scratch + (i - t) * kTileRows * K);
    kernel(scratch, t, te, w + (te - t0) * tile_bytes, kWidenTiles * tile_bytes);
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kIsa = "avx512-vnni";

// The weights of two consecutive 4-k chunks (c0, c0 + 1) of T tiles, as u = q + 128 bytes: loaded (8-bit
// layout), or widened in registers from the 5-bit one (see widen_q5_tile).
template <bool Q5, int T>
QB_ALWAYS_INLINE void load_chunk_pair(const uint8_t* w, int64_t K, int64_t c0, __m512i (&w0)[T], __m512i (&w1)[T]) {
  const int64_t tile_bytes = kTileRows * K * (Q5 ? 5 : 8) / 8;
  for (int t = 0; t < T; ++t) {
    const uint8_t* wt = w + t * tile_bytes;
    if constexpr (Q5) {
      const __m512i low4 = _mm512_set1_epi8(0x0F), base = _mm512_set1_epi8(0x70), sixteen = _mm512_set1_epi8(16);
      const __m512i nib = _mm512_loadu_si512(reinterpret_cast<const void*>(q5_nibbles(wt, c0)));
      const __m512i a = _mm512_ternarylogic_epi32(nib, low4, base, 0xEA);
      const __m512i b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(nib, 4), low4, base, 0xEA);
      uint64_t ka, kb;
      std::memcpy(&ka, q5_fifth(wt, c0), 8);
      std::memcpy(&kb, q5_fifth(wt, c0 + 1), 8);
      w0[t] = _mm512_mask_add_epi8(a, _cvtu64_mask64(ka), a, sixteen);
      w1[t] = _mm512_mask_add_epi8(b, _cvtu64_mask64(kb), b, sixteen);
    } else {
      w0[t] = _mm512_loadu_si512(reinterpret_cast<const void*>(wt + c0 * 64));
      w1[t] = _mm512_loadu_si512(reinterpret_cast<const void*>(wt + (c0 + 1) * 64));
    }
  }
}

// Asks for tile t's weight stream kPrefetchBytes past [offset, offset + bytes) into L2. Past the tile's end the
// stream goes on in tile t + T, the one that takes its place in the next call (a task's tiles are consecutive):
// stopping at the end left the next call's last tile to start cold, 2 KB of each 9 KB tile of the 5-bit gate_up.
// (A group that straddles the end still asks for tile t + 1's head.)
template <int T>
QB_ALWAYS_INLINE void prefetch_tile_ahead(const uint8_t* w, int64_t tile_bytes, int t, int64_t offset, int64_t bytes) {
  const int64_t past_end = offset + kPrefetchBytes >= tile_bytes ? (T - 1) * tile_bytes : 0;
  prefetch_ahead(w + t * tile_bytes + past_end + offset, bytes);
}

// MB rows of x against T tiles (16 * T weight rows, the first at column n0), all groups, into out. Streaming:
// whether the call may prefetch (decode steps' few rows); without, the code to do it is left out.
template <bool Q5, int MB, int T, bool Streaming = true>
inline void tile_kernel(const QuantizedX& xq, int64_t m0, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t n0, bool prefetch, StreamAhead* ahead) {
  const int64_t G = K / kGroup;
  __m512 acc[MB][T];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < T; ++t) acc[m][t] = _mm512_setzero_ps();
  // A row alone would wait on each vpdpbusd's latency: it gets two chains, even and odd chunks.
  constexpr int C = MB == 1 ? 2 : 1;
  constexpr int64_t kGroupBytes = kTileRows * kGroup * (Q5 ? 5 : 8) / 8;
  const int64_t tile_bytes = kTileRows * K * (Q5 ? 5 : 8) / 8;
  for (int64_t g = 0; g < G; ++g) {
    // Only the 5-bit layers' streams go on into the next call's tiles: their short tiles lost most by starting
    // cold (one-row gate_up 1.07x, four rows 1.32x, Zen 5). The 8-bit down's 76 KB tiles read 0.87x that way.
    for (int t = 0; t < T && Streaming && prefetch; ++t) {
      if constexpr (Q5)
        prefetch_tile_ahead<T>(w, tile_bytes, t, g * kGroupBytes, kGroupBytes);
      else
        prefetch_ahead(w + t * tile_bytes + g * kGroupBytes, kGroupBytes);
    }
    if (Streaming && ahead) ahead->step();
    __m512i dot[MB][T][C];
    for (int m = 0; m < MB; ++m)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) dot[m][t][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < kGroup / 4; j += 2) {
      const int64_t c0 = g * (kGroup / 4) + j;  // chunk c covers k = 4c .. 4c + 3
      __m512i w0[T], w1[T];
      load_chunk_pair<Q5, T>(w, K, c0, w0, w1);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xm = xq.q.data() + (m0 + m) * K + c0 * 4;
        const __m512i x0 = _mm512_set1_epi32(load4(xm)), x1 = _mm512_set1_epi32(load4(xm + 4));
        for (int t = 0; t < T; ++t) {
          dot[m][t][0] = _mm512_dpbusd_epi32(dot[m][t][0], w0[t], x0);
          dot[m][t][C - 1] = _mm512_dpbusd_epi32(dot[m][t][C - 1], w1[t], x1);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 ws = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (t * G + g) * kTileRows)));
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        const __m512i sum = C == 2 ? _mm512_add_epi32(dot[m][t][0], dot[m][t][C - 1]) : dot[m][t][0];
        const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(xq.bias[mg])));
        acc[m][t] = _mm512_fmadd_ps(d, _mm512_mul_ps(ws, _mm512_set1_ps(xq.scale[mg])), acc[m][t]);
      }
    }
  }
  alignas(64) float v[MB * T * kTileRows];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < T; ++t) _mm512_store_ps(v + (m * T + t) * kTileRows, acc[m][t]);
  out.store<MB, T>(m0, n0, v);
}

template <bool Q5, int T>
inline void rows_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t n0, StreamAhead* ahead) {
  int64_t m = rows.begin;
  // With few rows the tile streams from memory once, and the first row block prefetches it; with many the
  // kernel is bound by its arithmetic, and prefetching cost prefill ~5%.
  const bool stream = rows.count() <= kStreamRows;
  if constexpr (!Q5) {  // many rows (5-bit ones are widened first): bound by the arithmetic, nothing to prefetch
    if (!stream && !ahead)
      for (; m + 4 <= rows.end; m += 4) tile_kernel<false, 4, T, false>(xq, m, K, w, s, out, n0, false, nullptr);
  }
  for (; m + 4 <= rows.end; m += 4) tile_kernel<Q5, 4, T>(xq, m, K, w, s, out, n0, stream && m == rows.begin, ahead);
  for (; m + 2 <= rows.end; m += 2) tile_kernel<Q5, 2, T>(xq, m, K, w, s, out, n0, stream && m == rows.begin, ahead);
  for (; m < rows.end; ++m) tile_kernel<Q5, 1, T>(xq, m, K, w, s, out, n0, stream && m == rows.begin, ahead);
}

template <bool Q5>
inline void tiles_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                         const Output& out, int64_t t0, int64_t t1, StreamAhead* ahead = nullptr) {
  const int64_t G = K / kGroup;
  const int64_t tile_bytes = kTileRows * K * (Q5 ? 5 : 8) / 8;
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2)
    rows_kernel<Q5, 2>(xq, rows, K, w + (t - t0) * tile_bytes, s + t * G * kTileRows, out, t * kTileRows, ahead);
  for (; t < t1; ++t)
    rows_kernel<Q5, 1>(xq, rows, K, w + (t - t0) * tile_bytes, s + t * G * kTileRows, out, t * kTileRows, ahead);
}

// One task: tiles [t0, t1), whose weights start at w. From 9 to 16 rows (past decode's few, whose first row block
// streams its own tiles), short tiles (K up to kShortTileK) ask for the next pair's stream into L2 a few lines per
// group while their row blocks multiply: the first block found its tiles in memory, and the weight stream and the
// arithmetic took turns. The LM head (896 inputs) ran 1.42-1.56x at 9 rows, 1.04-1.16x at 16, but 0.90-0.96x at 32
// and 0.90-1.07x at 64; the 4,864-input down 0.88x at 9 rows (kernel_ab.py, Zen 5).
constexpr int64_t kShortTileK = 1024, kStreamAheadRows8 = 16;

inline void task_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t t0, int64_t t1) {
  if (rows.count() <= kStreamRows || rows.count() > kStreamAheadRows8 || K > kShortTileK)
    return tiles_kernel<false>(xq, rows, K, w, s, out, t0, t1);
  const int64_t tile_bytes = kTileRows * K;
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t te = std::min(t1, t + 2);
    StreamAhead ahead(w + (te - t0) * tile_bytes, 2 * tile_bytes, (rows.count() + 3) / 4 * (K / kGroup));
    tiles_kernel<false>(xq, rows, K, w + (t - t0) * tile_bytes, s, out, t, te, &ahead);
  }
}

// The same from 5-bit tiles: up to 8 rows of x widened in registers as they stream (each row block widens them
// again); for more, widened into `scratch` once.
inline void task_kernel_q5(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                           const Output& out, int64_t t0, int64_t t1, uint8_t* scratch) {
  if (rows.count() <= 8) {
    tiles_kernel<true>(xq, rows, K, w, s, out, t0, t1);
    return;
  }
  // The next tiles' stream asked for while these are multiplied: gate_up 1.11x at 9 rows, 1.07x at 16, 1.02x at 32
  // to 64; 0.98x at 256, where a prefill chunk's arithmetic hides the widening's reads anyway (Zen 5).
  const auto kernel = [&](const uint8_t* wt, int64_t t, int64_t te, const uint8_t* next, int64_t bytes) {
    if (rows.count() > kStreamAheadRows) return tiles_kernel<false>(xq, rows, K, wt, s, out, t, te);
    const int64_t steps = (rows.count() + 3) / 4 * ((te - t + 1) / 2) * (K / kGroup);  // tile_kernel calls x groups
    StreamAhead ahead(next, bytes, steps);
    tiles_kernel<false>(xq, rows, K, wt, s, out, t, te, &ahead);
  };
  widened_q5(w, K, t0, t1, scratch, kernel, widen_q5_tile);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";

// Without VNNI, vpmaddubsw multiplies unsigned by signed bytes into int16 pair sums, and vpmaddwd adds the pairs.
// 8-bit weights go llama.cpp's way: |x| times the weight with x's sign (pair sums at most 2 * 127 * 127 fit int16),
// the weight being q = u ^ 0x80. 5-bit weights need no signs: u5 = q + 16 is at most 31, so u5 * x pair sums fit
// (2 * 31 * 127), and the 16 * sum(x) they add is subtracted per group, as the VNNI kernel does with 128.
enum class Layout {
  kInt8,     // the 8-bit layout, u = q + 128
  kQ5,       // the 5-bit layout, widened in registers as it streams
  kU5Bytes,  // 5-bit tiles widened into a buffer, one u5 byte per weight, in the 8-bit layout's order
};

// The 32 bits at p to 32 bytes: byte b is 0xFF where bit b is set. The bits are broadcast straight from memory
// (load4, a load with no vector ALU op); read as one 16-byte copy of a chunk pair's bits, they went through general
// registers, a vmovd and a vpbroadcastd each: a fifth of the 5-bit one-row kernel's vector ops.
inline __m256i bits_to_bytes(const uint8_t* p) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(load4(reinterpret_cast<const int8_t*>(p))), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
}

// The weights of two consecutive 4-k chunks (c0 even, c0 + 1) of one tile, w[c][h] holding rows 8h .. 8h + 7:
// q = u ^ 0x80 from the 8-bit layout, else u5 bytes (loaded, or widened: nibble + 16 where the fifth bit is set).
template <Layout L>
QB_ALWAYS_INLINE void load_chunk_pair(const uint8_t* tile, int64_t c0, __m256i (&w)[2][2]) {
  if constexpr (L == Layout::kQ5) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    const uint8_t* fifth = q5_fifth(tile, c0);  // chunk c's rows 8h .. 8h + 7 at fifth + 8c + 4h: adjacent chunks
    for (int h = 0; h < 2; ++h) {
      const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q5_nibbles(tile, c0) + 32 * h));
      const __m256i lo = _mm256_and_si256(nib, low4), hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4);
      w[0][h] = _mm256_or_si256(lo, _mm256_and_si256(bits_to_bytes(fifth + 4 * h), sixteen));
      w[1][h] = _mm256_or_si256(hi, _mm256_and_si256(bits_to_bytes(fifth + 8 + 4 * h), sixteen));
    }
  } else {
    for (int c = 0; c < 2; ++c)
      for (int h = 0; h < 2; ++h) {
        w[c][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (c0 + c) * 64 + 32 * h));
        if constexpr (L == Layout::kInt8) w[c][h] = _mm256_xor_si256(w[c][h], _mm256_set1_epi8(static_cast<char>(0x80)));
      }
  }
}

// MB rows of x against one tile (16 weight rows, the first at column n0), all groups, into out. Stream: the tile
// comes from memory (a decode step's first row block), and each group asks for the stream kPrefetchBytes ahead
// into L2, past the tile's end into the next tile (a task's tiles are consecutive).
template <Layout L, int MB, bool Stream = false>
inline void tile_kernel(const QuantizedX& xq, int64_t m0, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t n0) {
  const int64_t G = K / kGroup;
  constexpr int64_t kGroupBytes = L == Layout::kQ5 ? kQ5GroupBytes : kGroup / 4 * 64;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (Stream) prefetch_ahead(w + g * kGroupBytes, kGroupBytes);
    __m256i dot[MB][2], sum16[MB][2];
    for (int m = 0; m < MB; ++m) dot[m][0] = dot[m][1] = sum16[m][0] = sum16[m][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < kGroup / 4; j += 2) {
      const int64_t c0 = g * (kGroup / 4) + j;  // chunk c covers k = 4c .. 4c + 3
      __m256i wc[2][2];
      load_chunk_pair<L>(w, c0, wc);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xm = xq.q.data() + (m0 + m) * K + c0 * 4;
        for (int c = 0; c < 2; ++c) {
          const __m256i xb = _mm256_set1_epi32(load4(xm + 4 * c));
          if constexpr (L == Layout::kInt8) {
            const __m256i ax = _mm256_sign_epi8(xb, xb);
            const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wc[c][0], xb));
            const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wc[c][1], xb));
            dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(p0, ones));
            dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(p1, ones));
          } else {
            sum16[m][0] = _mm256_add_epi16(sum16[m][0], _mm256_maddubs_epi16(wc[c][0], xb));
            sum16[m][1] = _mm256_add_epi16(sum16[m][1], _mm256_maddubs_epi16(wc[c][1], xb));
          }
        }
      }
      // u5 <= 31 and |q_x| <= 127 bound a pair sum by 7,874, so four chunks' sums fit int16 (31,496) and one
      // vpmaddwd widens four chunks rather than one: 2.5 multiplies per row and chunk instead of 4, 1.15-1.25x
      // on the 5-bit kernel from 16 rows up (8-bit products, up to 2 * 127 * 128 a pair, leave no such room).
      if constexpr (L != Layout::kInt8) {
        if (j % 4 == 2) {
          for (int m = 0; m < MB; ++m)
            for (int h = 0; h < 2; ++h) {
              dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_madd_epi16(sum16[m][h], ones));
              sum16[m][h] = _mm256_setzero_si256();
            }
        }
      }
    }
    const c10::Half* sg = s + g * kTileRows;
    const __m256 ws0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
    const __m256 ws1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8)));
    for (int m = 0; m < MB; ++m) {
      const int64_t mg = (m0 + m) * G + g;
      if constexpr (L != Layout::kInt8) {
        // 16 * sum(q_x) = (128 * sum(q_x)) >> 3, exact: broadcast from memory and shifted, no trip through a register
        const __m256i offset = _mm256_srai_epi32(_mm256_set1_epi32(xq.bias[mg]), 3);
        dot[m][0] = _mm256_sub_epi32(dot[m][0], offset);
        dot[m][1] = _mm256_sub_epi32(dot[m][1], offset);
      }
      const __m256 xs = _mm256_set1_ps(xq.scale[mg]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][0]), _mm256_mul_ps(ws0, xs), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][1]), _mm256_mul_ps(ws1, xs), acc[m][1]);
    }
  }
  alignas(32) float v[MB * kTileRows];
  for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(v + m * kTileRows, acc[m][0]);
    _mm256_store_ps(v + m * kTileRows + 8, acc[m][1]);
  }
  out.store<MB>(m0, n0, v);
}

// One row of x against T tiles of widened u5 bytes (the kU5Bytes layout: prefill chunks and decode steps of more
// than 2 rows). Zen 3 issues ~1.2 vpmaddubsw (+ vpaddw) a cycle when each takes its own broadcast of x from memory
// and ~1.6 from registers (benchmarks/avx2_issue_rates.cpp), so here each broadcast feeds 2T of them, the weights
// read straight from L1 as memory operands:
// 1.3x the two-rows-one-tile kernel's multiply-adds a cycle in a harness of the inner loops (27.7 against 21.4),
// but only 1.03-1.07x in the whole linear (benchmarks/kernel_ab.py, gate_up at 16-2,048 rows, AVX2 kind), where
// the rest of the call (stores into a 10 MB y, the other thread's share of a noisy host) weighs more.
template <int T>
inline void u5_row_kernel(const QuantizedX& xq, int64_t m, int64_t K, const uint8_t* w, const c10::Half* s,
                          const Output& out, int64_t n0) {
  const int64_t G = K / kGroup;
  const int64_t tile_bytes = kTileRows * K;
  const int8_t* xm = xq.q.data() + m * K;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2 * T];
  for (int h = 0; h < 2 * T; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[2 * T];
    // Four chunks' u5 * x pair sums fit int16 (see tile_kernel): two runs of four chunks per group.
    for (int q = 0; q < 2; ++q) {
      __m256i sum16[2 * T];
      for (int h = 0; h < 2 * T; ++h) sum16[h] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const int64_t chunk = g * (kGroup / 4) + q * 4 + c;
        const __m256i xb = _mm256_set1_epi32(load4(xm + chunk * 4));
        for (int h = 0; h < 2 * T; ++h) {
          const auto* wp = reinterpret_cast<const __m256i*>(w + (h / 2) * tile_bytes + chunk * 64 + 32 * (h % 2));
          sum16[h] = _mm256_add_epi16(sum16[h], _mm256_maddubs_epi16(_mm256_loadu_si256(wp), xb));
        }
      }
      for (int h = 0; h < 2 * T; ++h) {
        const __m256i d = _mm256_madd_epi16(sum16[h], ones);
        dot[h] = q == 0 ? d : _mm256_add_epi32(dot[h], d);
      }
    }
    const int64_t mg = m * G + g;
    const __m256i offset = _mm256_srai_epi32(_mm256_set1_epi32(xq.bias[mg]), 3);  // 16 * sum(q_x)
    const __m256 xs = _mm256_set1_ps(xq.scale[mg]);
    for (int h = 0; h < 2 * T; ++h) {
      const c10::Half* sg = s + (h / 2) * G * kTileRows + g * kTileRows + 8 * (h % 2);
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[h], offset)), _mm256_mul_ps(ws, xs), acc[h]);
    }
  }
  alignas(32) float v[T * kTileRows];
  for (int h = 0; h < 2 * T; ++h) _mm256_store_ps(v + 8 * h, acc[h]);
  out.store<1, T>(m, n0, v);
}

template <Layout L>
inline void tiles_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                         const Output& out, int64_t t0, int64_t t1) {
  const int64_t G = K / kGroup;
  const int64_t tile_bytes = kTileRows * K * (L == Layout::kQ5 ? 5 : 8) / 8;
  int64_t t = t0;
  if constexpr (L == Layout::kU5Bytes) {
    for (; t + 2 <= t1; t += 2)
      for (int64_t m = rows.begin; m < rows.end; ++m)
        u5_row_kernel<2>(xq, m, K, w + (t - t0) * tile_bytes, s + t * G * kTileRows, out, t * kTileRows);
  }
  for (; t < t1; ++t) {
    const uint8_t* wt = w + (t - t0) * tile_bytes;
    const c10::Half* st = s + t * G * kTileRows;
    int64_t m = rows.begin;
    if constexpr (L != Layout::kU5Bytes) {  // widened tiles are in cache already
      if (rows.count() <= kStreamRows) {     // decode steps: the first row block streams the tile from memory
        if (rows.count() == 1) {
          tile_kernel<L, 1, true>(xq, m, K, wt, st, out, t * kTileRows);
          continue;
        }
        tile_kernel<L, 2, true>(xq, m, K, wt, st, out, t * kTileRows);
        m += 2;
      }
    }
    for (; m + 2 <= rows.end; m += 2) tile_kernel<L, 2>(xq, m, K, wt, st, out, t * kTileRows);
    for (; m < rows.end; ++m) tile_kernel<L, 1>(xq, m, K, wt, st, out, t * kTileRows);
  }
}

inline void task_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t t0, int64_t t1) {
  tiles_kernel<Layout::kInt8>(xq, rows, K, w, s, out, t0, t1);
}

// 5-bit tiles: for one or two rows of x widened in registers as they stream (each pair of rows widens them again);
// for more, each tile once into `scratch` as u5 bytes (the VNNI kernel's u = q + 128 would need the sign trick
// again), which every row then reads.
inline void task_kernel_q5(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                           const Output& out, int64_t t0, int64_t t1, uint8_t* scratch) {
  if (rows.count() <= 2) {
    tiles_kernel<Layout::kQ5>(xq, rows, K, w, s, out, t0, t1);
    return;
  }
  widened_q5(
      w, K, t0, t1, scratch,
      [&](const uint8_t* wt, int64_t t, int64_t te, const uint8_t*, int64_t) {
        tiles_kernel<Layout::kU5Bytes>(xq, rows, K, wt, s, out, t, te);
      },
      [](const uint8_t* src, int64_t K, uint8_t* dst) {
        for (int64_t c = 0; c < K / 4; c += 2) {
          if (c % 8 == 0) prefetch_ahead(src + c / 8 * kQ5GroupBytes, kQ5GroupBytes, kWidenPrefetchBytes);
          __m256i u5[2][2];
          load_chunk_pair<Layout::kQ5>(src, c, u5);
          for (int i = 0; i < 2; ++i)
            for (int h = 0; h < 2; ++h)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (c + i) * 64 + 32 * h), u5[i][h]);
        }
      });
}
#else
constexpr const char* kIsa = "portable";

inline void task_kernel(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                        const Output& out, int64_t t0, int64_t t1) {
  const int64_t G = K / kGroup;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + (t - t0) * kTileRows * K;
    const c10::Half* st = s + t * G * kTileRows;
    for (int64_t m = rows.begin; m < rows.end; ++m) {
      const int8_t* xm = xq.q.data() + m * K;
      float acc[kTileRows] = {};
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot[kTileRows] = {};
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4)
          for (int64_t r = 0; r < kTileRows; ++r)
            for (int64_t i = 0; i < 4; ++i)
              dot[r] += static_cast<int32_t>(wt[k * kTileRows + r * 4 + i]) * xm[k + i];
        const float xs = xq.scale[m * G + g];
        const int32_t bias = xq.bias[m * G + g];
        for (int64_t r = 0; r < kTileRows; ++r)
          acc[r] += static_cast<float>(dot[r] - bias) * (static_cast<float>(st[g * kTileRows + r]) * xs);
      }
      out.store(m, t * kTileRows, acc);
    }
  }
}

inline void task_kernel_q5(const QuantizedX& xq, Rows rows, int64_t K, const uint8_t* w, const c10::Half* s,
                           const Output& out, int64_t t0, int64_t t1, uint8_t* scratch) {
  widened_q5(
      w, K, t0, t1, scratch,
      [&](const uint8_t* wt, int64_t t, int64_t te, const uint8_t*, int64_t) { task_kernel(xq, rows, K, wt, s, out, t, te); },
      widen_q5_tile);
}
#endif

// Tasks are claimed by the threads in shrinking runs (OpenMP's guided schedule): a thread's first run is a
// 1 / (2 * threads) share of what is left, the last ones a task each. at::parallel_for splits a range in equal
// shares, and on a shared host one core is often slower for a while: the other then waits out the difference.
class TaskClaims {
 public:
  TaskClaims(int64_t tasks, int64_t threads) : tasks_(tasks), threads_(std::max<int64_t>(1, threads)) {}

  // The next run [begin, end), empty when all are taken.
  std::pair<int64_t, int64_t> next() {
    int64_t begin = next_.load(std::memory_order_relaxed), size;
    do {
      if (begin >= tasks_) return {tasks_, tasks_};
      size = std::max<int64_t>(1, (tasks_ - begin) / (2 * threads_));
    } while (!next_.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed));
    return {begin, begin + size};
  }

 private:
  const int64_t tasks_, threads_;
  std::atomic<int64_t> next_{0};
};

}  // namespace

// x: [M, K] float32, bfloat16 or float16; w: packed uint8, N * K bytes (bits = 8) or N * K * 5 / 8 (bits = 5);
// scales: float16 [N * K / 32]; bias: [N] or None. Returns [M, N] in x's dtype; with silu_and_mul, [M, N / 2]:
// SiLU(gate) * up of a gated MLP packed with its gate and up rows interleaved 8 by 8.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t bits, bool silu_and_mul) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0 && N % kTileRows == 0, "int8_linear: K must divide by 32 and N by 16");
  TORCH_CHECK(bits == 8 || bits == 5, "int8_linear: bits must be 8 or 5");
  const int64_t tile_bytes = kTileRows * K * bits / 8;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N / kTileRows * tile_bytes,
              "int8_linear: w must be contiguous uint8 with N * K * bits / 8 elements");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * K / kGroup,
              "int8_linear: scales must be contiguous float16 with N * K / 32 elements");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "int8_linear: x must be float32, bfloat16 or float16");
  const at::Tensor xc = x.contiguous();
  QuantizedX xq;
  switch (x.scalar_type()) {
    case at::kBFloat16: xq = quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K); break;
    case at::kHalf: xq = quantize_rows(xc.data_ptr<c10::Half>(), M, K); break;
    default: xq = quantize_rows(xc.data_ptr<float>(), M, K);
  }
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "int8_linear: bias must have N elements");
  }
  const int64_t width = silu_and_mul ? N / 2 : N;
  at::Tensor y = at::empty({M, width}, x.options());
  if (M == 0) return y;  // the kernels assume rows: a streaming row block of none would read and write past them
  const Output out{y.data_ptr(), x.scalar_type(), width, bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                   silu_and_mul};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const int64_t tiles = N / kTileRows, threads = at::get_num_threads();
  const Int8Tasks plan = int8_tasks(M, K, tiles, threads);
  TaskClaims claim(plan.count(), threads);
  at::parallel_for(0, std::min(threads, plan.count()), 1, [&](int64_t, int64_t) {
    // Not zeroed (new[], not a vector): widening writes it before any read, and one-row calls never touch it, whose
    // memset was 0.5% of a decode step.
    const std::unique_ptr<uint8_t[]> scratch(new uint8_t[bits == 5 ? kWidenTiles * kTileRows * K : 0]);
    for (;;) {
      const auto [begin, end] = claim.next();
      if (begin == end) break;
      // A run's row blocks are consecutive tasks, so a thread's next task often reads the weights it just read.
      for (int64_t task = begin; task < end; ++task) {
        const int64_t run = task / plan.row_blocks, block = task % plan.row_blocks;
        const int64_t t0 = run * plan.tiles_per_task, t1 = std::min(tiles, t0 + plan.tiles_per_task);
        const auto [first, end] = plan.rows_of(block, M);
        const Rows rows{first, end};
        if (bits == 8)
          task_kernel(xq, rows, K, wp + t0 * tile_bytes, sp, out, t0, t1);
        else
          task_kernel_q5(xq, rows, K, wp + t0 * tile_bytes, sp, out, t0, t1, scratch.get());
      }
    }
  });
  return y;
}

std::string isa() { return kIsa; }
