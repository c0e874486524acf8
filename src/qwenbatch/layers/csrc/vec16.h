// Float32 helpers on 16 AVX-512 lanes for the kernels' loops that GCC's vectorization leaves slow: exp, SiLU,
// bf16 <-> float32.
//
// SiLU(gate) * up: GCC's vectorization of qb::silu_times (float_math.h) spent a vdivps on every 16 lanes (~10
// cycles, on one port) and a dozen integer steps on each bf16 rounding: 1.5 cycles an output on one thread with the
// rows in cache, 1.2 with silu16 below, where the quotient is a reciprocal estimate refined by one Newton step
// (within 2 ulp of the division) and a round to bf16 is vcvtneps2bf16 where the CPU has it. The values are
// qb::silu_times's but in the last float32 bit or two, which a bf16 rounding keeps in all but a few outputs in
// 10,000. (A prefill chunk's 2,048 rows are not in cache, and there the pass is bound by memory.)
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace qb {

// exp(x) for x <= 0: 2^(x log2 e) split into 2^n, applied by vscalefps (0 once n is below float's range, so
// exp(-inf) = 0 with no clamp but t's), and 2^f, f in [-0.5, 0.5], by a polynomial: of degree 6 (vec_exp's, relative
// error below 3e-7) or of degree 4 (least squares, 7e-6: enough for values rounded to bf16, 4e-3, afterwards).
template <int kDegree>
__attribute__((always_inline)) inline __m512 exp16_nonpositive(__m512 x) {
  static_assert(kDegree == 4 || kDegree == 6);
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-151.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (kDegree == 6) {
    p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180428e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  } else {
    p = _mm512_set1_ps(9.6707631e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5875502e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022212e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312727e-1f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// SiLU(g) = g * sigmoid(g), with e = exp(-|g|) in (0, 1]: sigmoid(|g|) = 1 / (1 + e) and sigmoid(-|g|) = e / (1 + e).
// The divisor stays in [1, 2], where the reciprocal estimate and its Newton step hold; SiLU(-inf) is NaN and
// SiLU(inf) inf, as g / (1 + exp(-g)) gives them.
__attribute__((always_inline)) inline __m512 silu16(__m512 g) {
  const __m512 e = exp16_nonpositive<6>(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r, r);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(g, _mm512_mask_mul_ps(r, negative, r, e));
}

// bf16 <-> float32 on 16 lanes; the round is to nearest even (vcvtneps2bf16 where the CPU has it: it also takes
// results below 2^-126, bf16's subnormals, to zero, where the integer steps and PyTorch keep them).
__attribute__((always_inline)) inline __m512 bf16_to_f32x16(const void* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

__attribute__((always_inline)) inline __m256i f32_to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}

// v rounded to the nearest bf16, as float32
__attribute__((always_inline)) inline __m512 round_to_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32_to_bf16x16(v)), 16));
}

}  // namespace qb

#endif  // __AVX512F__
