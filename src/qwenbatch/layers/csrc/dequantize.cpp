// int8_dequantize: a packed int8_linear weight (int8_layout.h) written back as a bf16 matrix, for a dense bf16
// matmul at many rows of x (layers/int8_large_m.py). In a source of its own: added to int8_linear.cpp, it made GCC
// take the widening pass out of line there, and the 5-bit kernels ran 0.57-0.69x as fast (see QB_ALWAYS_INLINE).
#include "bf16_vectors.h"
#include "float_math.h"
#include "int8_layout.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <vector>

namespace {

using namespace qb;  // the layout, bf16 vectors

// One chunk of a tile (4 k by 16 rows, u = q + 128, `s` the rows' scales) as bf16 into rows k .. k + 3 of W^T
// (`out`, N wide): each row's 16 values split in two halves of 8, at `columns[0]` and `columns[1]`.
inline void dequantize_chunk(const uint8_t* u, const c10::Half* s, c10::BFloat16* out, int64_t N,
                             const int64_t (&columns)[2]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Per row scale in a lane: 16 lanes, one row each; the chunk's 64 bytes are those rows' 4 k.
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(u));
  for (int b = 0; b < 4; ++b) {
    const __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(0xFF)),
                                       _mm512_set1_epi32(128));
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);  // finite: |q| <= 128 times a float16
    const __m256i h = f32_to_bf16x16(f);
    c10::BFloat16* row = out + b * N;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + columns[0]), _mm256_castsi256_si128(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + columns[1]), _mm256_extracti128_si256(h, 1));
  }
#else
  for (int b = 0; b < 4; ++b) {
    float v[kTileRows];
#pragma omp simd
    for (int r = 0; r < kTileRows; ++r) v[r] = static_cast<float>(u[r * 4 + b] - 128) * static_cast<float>(s[r]);
    c10::BFloat16* row = out + b * N;
    for (int h = 0; h < 2; ++h)
#pragma omp simd
      for (int r = 0; r < kTileRows / 2; ++r) row[columns[h] + r] = qb::from_f32<c10::BFloat16>(v[h * 8 + r]);
  }
#endif
}

}  // namespace

// The bfloat16 weight that packed w stands for, transposed: [K, N] with W^T[k][n] = q * s rounded to bfloat16,
// for a dense bf16 matmul (oneDNN, in AMX tiles where the CPU has them) at many rows of x. With gate_up_halves,
// w is a gated MLP's gate_up, its rows interleaved 8 by 8, and the columns come out in [gate; up] order.
at::Tensor int8_dequantize(const at::Tensor& w, const at::Tensor& scales, int64_t N, int64_t K, int64_t bits,
                           bool gate_up_halves) {
  TORCH_CHECK(K % kGroup == 0 && N % kTileRows == 0, "int8_dequantize: K must divide by 32 and N by 16");
  TORCH_CHECK(bits == 8 || bits == 5, "int8_dequantize: bits must be 8 or 5");
  const int64_t tile_bytes = kTileRows * K * bits / 8, G = K / kGroup;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N / kTileRows * tile_bytes,
              "int8_dequantize: w must be contiguous uint8 with N * K * bits / 8 elements");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * G,
              "int8_dequantize: scales must be contiguous float16 with N * K / 32 elements");
  at::Tensor out = at::empty({K, N}, at::kBFloat16);
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  constexpr int64_t kHalf = kTileRows / 2;
  at::parallel_for(0, N / kTileRows, 4, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> widened(bits == 5 ? kTileRows * K : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* u = wp + t * tile_bytes;  // u = q + 128, [K / 4][16 rows][4]
      if (bits == 5) {
        widen_q5_tile(u, K, widened.data());
        u = widened.data();
      }
      const int64_t columns[2] = {gate_up_halves ? t * kHalf : t * kTileRows,
                                  gate_up_halves ? N / 2 + t * kHalf : t * kTileRows + kHalf};
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = g * 8; c < g * 8 + 8; ++c)
          dequantize_chunk(u + c * 64, sp + (t * G + g) * kTileRows, o + c * 4 * N, N, columns);
    }
  });
  return out;
}
