// bf16 <-> float32 in vector registers, for the kernels written in intrinsics. A bf16 value is the top half of
// a float32, so widening is a shift; narrowing rounds to nearest even, as qb::from_f32 does.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace qb {

#if defined(__AVX512F__)
// 16 bf16 values (the low 16 bits of each lane's place in a 256-bit load) as 16 float32 lanes.
inline __m512 bf16x16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

inline __m512 load_bf16x16(const c10::BFloat16* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#if defined(__AVX512BF16__)
// One vcvtneps2bf16; a float32 below 2^-126 becomes zero (~1e-38 from where qb::from_f32 puts it).
inline __m256i f32_to_bf16x16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#elif defined(__AVX512BW__)
// The integer rounding of qb::from_f32 for finite values: add 0x7FFF plus the kept half's lowest bit, keep the top.
inline __m256i f32_to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}
#endif

inline void store_bf16x16(c10::BFloat16* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#endif

#if defined(__AVX2__)
// 8 bf16 values as 8 float32 lanes.
inline __m256 load_bf16x8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

}  // namespace qb

#endif
