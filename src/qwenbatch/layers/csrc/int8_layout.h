// The int8 linear's packed weight layout (described at the top of int8_linear.cpp), shared by the kernel and by
// int8_dequantize (dequantize.cpp): its sizes, where a 5-bit tile keeps each chunk, and the pass that widens a
// 5-bit tile into the 8-bit layout.
#pragma once
#include "prefetch.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// For the small helpers of the kernels' inner loops. GCC decides what to inline within a budget for the whole
// source file, so adding code anywhere in int8_linear.cpp moved those decisions: once the widening pass went out of
// line, once the tile kernels' stores, and the 5-bit kernels ran 0.57-0.76x as fast (benchmarks/kernel_ab.py, Zen 5).
// Not for Output's stores: forced inline they slowed the AVX2 one-row kernel 0.60x, kept out of line 0.89x.
#define QB_ALWAYS_INLINE __attribute__((always_inline)) inline

namespace qb {

constexpr int64_t kGroup = 32;          // weights per scale
constexpr int64_t kTileRows = 16;       // weight rows per tile
constexpr int64_t kQ5GroupBytes = 320;  // one tile's 32 k in the 5-bit layout: 256 bytes of nibbles, 64 of fifth bits
// How far ahead of its dot products a tile's weight stream is prefetched into L2. The hardware prefetchers
// alone leave memory and arithmetic mostly serial at one row: the 5-bit layers streamed at 18 GB/s against
// 56 GB/s from cache and ~31 GB/s of read bandwidth; with this, 22 GB/s (AVX-512 BF16 kind, Zen 4, median of 15;
// 2 to 8 KB ahead alike there). On Zen 5, 2 KB ran a one-row gate_up 1.05x faster than 4 KB, 8 KB 0.87x.
constexpr int64_t kPrefetchBytes = 2048;
// The widening pass (see widen_q5_tile) does nothing but stream, so it wants more bytes in flight than a dot
// product loop that overlaps its loads with arithmetic: 8 KB ahead ran gate_up at 9 / 16 rows 1.29x / 1.12x faster
// than 2 KB, and 16 KB as 8 (Zen 5).
constexpr int64_t kWidenPrefetchBytes = 8192;

// Where chunk c's nibble block and fifth bits are in a 5-bit tile.
inline const uint8_t* q5_nibbles(const uint8_t* tile, int64_t c) { return tile + (c / 8) * kQ5GroupBytes + (c % 8) / 2 * 64; }
inline const uint8_t* q5_fifth(const uint8_t* tile, int64_t c) { return tile + (c / 8) * kQ5GroupBytes + 256 + (c % 8) * 8; }

// Asks for the weight stream `distance` bytes past [p, p + bytes) into L2.
QB_ALWAYS_INLINE void prefetch_ahead(const uint8_t* p, int64_t bytes, int64_t distance = kPrefetchBytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    prefetch_l2(p + distance + line);
}

// Widens one tile of 5-bit weights (10 * K bytes) into the int8 layout (16 * K bytes, u = q + 128). The widening
// pass is the tile's one read from memory: unprefetched, it stalled on each group (9.7% of a 16 x 256 -> 64 run, perf);
// 2 KB ahead, still 6.5% with two thirds of it waiting on loads.
QB_ALWAYS_INLINE void widen_q5_tile(const uint8_t* src, int64_t K, uint8_t* dst) {
#if defined(__AVX512BW__)
  const __m512i low4 = _mm512_set1_epi8(0x0F), base = _mm512_set1_epi8(0x70), sixteen = _mm512_set1_epi8(16);
  for (int64_t c = 0; c < K / 4; c += 2) {
    if (c % 8 == 0) prefetch_ahead(src + c / 8 * kQ5GroupBytes, kQ5GroupBytes, kWidenPrefetchBytes);
    const __m512i nib = _mm512_loadu_si512(reinterpret_cast<const void*>(q5_nibbles(src, c)));
    // (nib & 0x0F) | 0x70 is nib + 112; adding 16 where the fifth bit is set makes u5 + 112 = q + 128.
    __m512i a = _mm512_ternarylogic_epi32(nib, low4, base, 0xEA);
    __m512i b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(nib, 4), low4, base, 0xEA);
    uint64_t ka, kb;
    std::memcpy(&ka, q5_fifth(src, c), 8);
    std::memcpy(&kb, q5_fifth(src, c + 1), 8);
    a = _mm512_mask_add_epi8(a, _cvtu64_mask64(ka), a, sixteen);
    b = _mm512_mask_add_epi8(b, _cvtu64_mask64(kb), b, sixteen);
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + c * 64), a);
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + (c + 1) * 64), b);
  }
#else
  for (int64_t c = 0; c < K / 4; ++c)
    for (int64_t b = 0; b < 64; ++b) {
      const int nib = (q5_nibbles(src, c)[b] >> (4 * (c % 2))) & 0x0F;
      const int fifth = (q5_fifth(src, c)[b / 8] >> (b % 8)) & 1;
      dst[c * 64 + b] = static_cast<uint8_t>(112 + nib + 16 * fifth);
    }
#endif
}

}  // namespace qb
