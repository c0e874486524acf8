// How many vpmaddubsw a cycle this core issues, alone and in the int8 kernel's patterns (BENCHMARKS.md, AVX2 kind).
// The clock is taken from a chain of dependent integer adds (one a cycle). Never run by CI:
//
//   g++ -O2 -march=x86-64-v3 benchmarks/avx2_issue_rates.cpp -o /tmp/rates && /tmp/rates
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

#define R12(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define DECLARE(j) __m256i v##j = _mm256_set1_epi8(j + 1);
#define KEEP asm volatile("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3), "+x"(v4), "+x"(v5), "+x"(v6), "+x"(v7), \
                                "+x"(v8), "+x"(v9), "+x"(v10), "+x"(v11))
#define RATE(name, OP)                                                          \
  {                                                                             \
    const double t = now();                                                     \
    for (long i = 0; i < kIters; ++i) {                                         \
      const int8_t* p = xs + (i & 63) * 48;                                     \
      (void)p;                                                                  \
      R12(OP) KEEP;                                                             \
      asm volatile("" : "+x"(w), "+x"(xr));                                     \
    }                                                                           \
    std::printf("%-44s %.2f a cycle\n", name, 12.0 * kIters / (now() - t) / clock); \
  }

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

int main() {
  const long kAdds = 100000000, kIters = 20000000;
  long a = 0;
  double t = now();
  for (long i = 0; i < kAdds; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(a));
  const double clock = 4.0 * kAdds / (now() - t);
  std::printf("clock ~ %.2f GHz\n", clock / 1e9);
  alignas(64) int8_t xs[4096];
  for (int i = 0; i < 4096; ++i) xs[i] = static_cast<int8_t>(i * 7);
  __m256i w = _mm256_set1_epi8(3), xr = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  R12(DECLARE)
#define MADDUBS(j) v##j = _mm256_maddubs_epi16(v##j, w);
#define MADDWD(j) v##j = _mm256_madd_epi16(v##j, ones);
#define ADDW(j) v##j = _mm256_add_epi16(v##j, w);
#define ACC_REG(j) v##j = _mm256_add_epi16(v##j, _mm256_maddubs_epi16(v##j, xr));
#define ACC_BCAST(j) v##j = _mm256_add_epi16(v##j, _mm256_maddubs_epi16(v##j, _mm256_set1_epi32(load4(p + 4 * j))));
  RATE("vpmaddubsw alone", MADDUBS)
  RATE("vpmaddwd alone", MADDWD)
  RATE("vpaddw alone", ADDW)
  RATE("vpmaddubsw + vpaddw, x in a register", ACC_REG)
  RATE("vpmaddubsw + vpaddw, x broadcast from memory", ACC_BCAST)
#define ACC_BCASTSS(j)    \
  v##j = _mm256_add_epi16(v##j, _mm256_maddubs_epi16(v##j, _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p + 4 * j)))));
  RATE("vpmaddubsw + vpaddw, x by vbroadcastss", ACC_BCASTSS)
  int sum = 0;
#define SUM(j) sum += _mm256_extract_epi32(v##j, 0);
  R12(SUM)
  std::printf("(%d %ld)\n", sum, a);
}
