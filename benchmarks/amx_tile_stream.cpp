// What bounds a bf16 linear on AMX tiles at a decode step's rows: how fast 2 threads stream weights from memory
// with plain vector loads, with tile loads feeding a fixed number of tile products, and as an M-row linear
// (x read in place, weights in 1 KB B tiles). BENCHMARKS.md, "Decode attention on AMX tiles" has the figures.
// `overlap` asks whether a core streams memory while its tile products run: the stream alone, the products alone
// (ROWS / 16 a KB, on tiles loaded once) and the two interleaved; BENCHMARKS.md, "Side by side in fresh
// processes", has the figures. `gemm` times a many-row bf16 matmul of our own on the tiles (2 x 2 tiles of 16 x 16
// a step, K in blocks whose weight panel stays in L2), its operands from memory as a matmul reads them, the x tiles
// from one L1 buffer (`x-l1`), both from L1 (`l1`) or no loads at all (`none`); BENCHMARKS.md, "Temperature-only
// rows in two passes; an AMX matmul of our own", has the figures. Never run by CI.
//
//   g++ -O2 -march=native -fopenmp benchmarks/amx_tile_stream.cpp -o /tmp/amx_tile_stream
//   OMP_NUM_THREADS=2 /tmp/amx_tile_stream stream|tiles2|tiles4 [prefetch bytes ahead]
//   OMP_NUM_THREADS=2 /tmp/amx_tile_stream linear ROWS [prefetch bytes ahead]
//   OMP_NUM_THREADS=1 /tmp/amx_tile_stream overlap ROWS
//   OMP_NUM_THREADS=2 /tmp/amx_tile_stream gemm M N K K_BLOCK [memory|x-l1|l1|none]
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void prefetch_tile(const char* at, const char* end) {
  if (at < end)
    for (int line = 0; line < 16; ++line) _mm_prefetch(at + 64 * line, _MM_HINT_T1);
}

// 1 GiB read once by 2 threads: plain loads, or 1 KB tiles each feeding `products` tile products (2 or 4, their A
// tiles reloaded from L1 as a 64-row linear reloads its rows).
double stream_gbs(const char* buf, size_t bytes, int products, int ahead) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    const size_t per = bytes / omp_get_num_threads();
    const char *p = buf + omp_get_thread_num() * per, *end = p + per;
    alignas(64) uint16_t a[2][512] = {};
    if (products == 0) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (const char* q = p; q < end; q += 256)
        for (int i = 0; i < 4; ++i) acc[i] = _mm512_add_ps(acc[i], _mm512_load_ps(q + 64 * i));
      const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
      volatile float sink = _mm512_reduce_add_ps(total);
      (void)sink;
    } else {
      static const TileConfig config;  // static: built at compile time (GCC 12 dropped stores to a stack copy)
      _tile_loadconfig(&config);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (const char* q = p; q < end; q += 1024) {
        if (ahead) prefetch_tile(q + ahead, end);
        _tile_loadd(6, q, 64);
        _tile_loadd(4, a[0], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a[1], 64);
        _tile_dpbf16ps(1, 5, 6);
        if (products == 4) {
          _tile_loadd(4, a[0], 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, a[1], 64);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
      _tile_release();
    }
  }
  return bytes / seconds_since(t0) / 1e9;
}

// 1 GiB read by the threads with plain loads (`stream`), or `products` tile products a KB on tiles loaded once and
// nothing read (`stream` false), or both interleaved; GB/s of the buffer.
double overlap_gbs(const char* buf, size_t bytes, int products, bool stream) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    const size_t per = bytes / omp_get_num_threads();
    const char *p = buf + omp_get_thread_num() * per, *end = p + per;
    static const TileConfig config;  // static: built at compile time (GCC 12 dropped stores to a stack copy)
    // Not zeros: products of zero tiles ran ~1.2x faster here (57.4 against 49.4 GB/s-equivalent at 4 a KB).
    alignas(64) uint16_t operand[512];
    std::fill(operand, operand + 512, uint16_t{0x3f80});  // bf16 1.0
    _tile_loadconfig(&config);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64);
    for (const char* q = p; q < end; q += 1024) {
      // asm: loads whose values nothing uses, which the compiler would otherwise drop
      if (stream)
        for (int line = 0; line < 16; ++line) asm volatile("vmovdqa64 (%0), %%zmm16" ::"r"(q + 64 * line) : "xmm16");
      if (products > 0) _tile_dpbf16ps(0, 4, 6);
      if (products > 1) _tile_dpbf16ps(1, 5, 6);
      if (products > 2) _tile_dpbf16ps(2, 4, 6);
      if (products > 3) _tile_dpbf16ps(3, 5, 6);
    }
    _tile_release();
  }
  return bytes / seconds_since(t0) / 1e9;
}

// y[M, N] = x[M, K] . W^T for M <= 64: each thread a run of 16-column blocks, each block's K/32 B tiles streamed
// once against the M/16 row tiles of x, loaded in place (rows K * 2 bytes apart).
void linear(const uint16_t* x, const uint16_t* tiles, float* y, int M, int N, int K, int ahead) {
#pragma omp parallel
  {
    static const TileConfig config;  // static: built at compile time (GCC 12 dropped stores to a stack copy)
    _tile_loadconfig(&config);
    const int blocks = N / 16, steps = K / 32, t = omp_get_thread_num(), nt = omp_get_num_threads();
    const char* end = reinterpret_cast<const char*>(tiles + static_cast<size_t>(blocks * (t + 1) / nt) * steps * 512);
    for (int j = blocks * t / nt; j < blocks * (t + 1) / nt; ++j) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int s = 0; s < steps; ++s) {
        const uint16_t* b = tiles + (static_cast<size_t>(j) * steps + s) * 512;
        if (ahead) prefetch_tile(reinterpret_cast<const char*>(b) + ahead, end);
        _tile_loadd(6, b, 64);
        const uint16_t* a = x + s * 32;
        _tile_loadd(4, a, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (M > 16) {
          _tile_loadd(5, a + 16 * K, K * 2);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (M > 32) {
          _tile_loadd(4, a + 32 * K, K * 2);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (M > 48) {
          _tile_loadd(5, a + 48 * K, K * 2);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
      float* out = y + static_cast<size_t>(j) * 16;
      _tile_stored(0, out, N * 4);
      if (M > 16) _tile_stored(1, out + 16 * N, N * 4);
      if (M > 32) _tile_stored(2, out + 32 * N, N * 4);
      if (M > 48) _tile_stored(3, out + 48 * N, N * 4);
    }
    _tile_release();
  }
}


enum class Operands { kMemory, kXFromL1, kFromL1, kNone };

// y[M, N] = x[M, K] . W^T in float32, M a multiple of 32 split between the threads, N of 32, K of kb (K_BLOCK, a
// multiple of 32). W is packed as [K / kb][N / 16][kb / 32] B tiles of 1 KB; each step takes 2 A tiles of x (32 rows,
// read in place) and 2 B tiles into 4 accumulators, stored to y (and loaded back for the next K block).
void gemm(const uint16_t* x, const uint16_t* packed, float* y, int M, int N, int K, int kb, Operands operands) {
#pragma omp parallel
  {
    static const TileConfig config;  // static: built at compile time (GCC 12 dropped stores to a stack copy)
    _tile_loadconfig(&config);
    alignas(64) static thread_local uint16_t l1[1024];
    const int t = omp_get_thread_num(), nt = omp_get_num_threads(), pairs = M / 32;
    const int r0 = pairs * t / nt * 32, r1 = pairs * (t + 1) / nt * 32, columns = N / 16, steps = kb / 32;
    const bool load_x = operands != Operands::kNone, x_in_place = operands == Operands::kMemory;
    const bool load_w = operands != Operands::kNone, w_in_place = operands == Operands::kMemory ||
                                                                  operands == Operands::kXFromL1;
    for (int k0 = 0; k0 < K; k0 += kb)
      for (int r = r0; r < r1; r += 32)
        for (int c = 0; c < columns; c += 2) {
          float* out = y + static_cast<size_t>(r) * N + c * 16;
          if (k0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, out, N * 4);
            _tile_loadd(1, out + 16 * N, N * 4);
            _tile_loadd(2, out + 16, N * 4);
            _tile_loadd(3, out + 16 * N + 16, N * 4);
          }
          const uint16_t* b0 = packed + (static_cast<size_t>(k0 / kb * columns + c) * steps) * 512;
          const uint16_t* b1 = b0 + static_cast<size_t>(steps) * 512;
          const uint16_t* a = x + static_cast<size_t>(r) * K + k0;
          for (int s = 0; s < steps; ++s) {
            if (load_x) _tile_loadd(4, x_in_place ? a + s * 32 : l1, x_in_place ? K * 2 : 64);
            if (load_w) _tile_loadd(6, w_in_place ? b0 + s * 512 : l1, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (load_x) _tile_loadd(5, x_in_place ? a + 16 * K + s * 32 : l1 + 512, x_in_place ? K * 2 : 64);
            _tile_dpbf16ps(1, 5, 6);
            if (load_w) _tile_loadd(7, w_in_place ? b1 + s * 512 : l1 + 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, out, N * 4);
          _tile_stored(1, out + 16 * N, N * 4);
          _tile_stored(2, out + 16, N * 4);
          _tile_stored(3, out + 16 * N + 16, N * 4);
        }
    _tile_release();
  }
}

int gemm_main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s gemm M N K K_BLOCK [memory|x-l1|l1|none]\n", argv[0]);
    return 1;
  }
  const int M = std::atoi(argv[2]), N = std::atoi(argv[3]), K = std::atoi(argv[4]), kb = std::atoi(argv[5]);
  const std::string which = argc > 6 ? argv[6] : "memory";
  const Operands operands = which == "none" ? Operands::kNone : which == "l1" ? Operands::kFromL1
                            : which == "x-l1" ? Operands::kXFromL1 : Operands::kMemory;
  std::vector<uint16_t> x(static_cast<size_t>(M) * K), w(static_cast<size_t>(N) * K), packed(w.size());
  std::vector<float> y(static_cast<size_t>(M) * N);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(0x3f80 + i % 7);  // bf16 1.0 and a little more
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3c00 + i % 5);
  const int columns = N / 16, steps = kb / 32;
  for (int k0 = 0; k0 < K; k0 += kb)
    for (int c = 0; c < columns; ++c)
      for (int s = 0; s < steps; ++s)
        for (int pair = 0; pair < 16; ++pair)
          for (int n = 0; n < 16; ++n)
            for (int e = 0; e < 2; ++e)
              packed[((static_cast<size_t>(k0 / kb * columns + c) * steps + s) * 16 + pair) * 32 + n * 2 + e] =
                  w[static_cast<size_t>(c * 16 + n) * K + k0 + s * 32 + 2 * pair + e];
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(x.data(), packed.data(), y.data(), M, N, K, kb, operands);
    best = std::min(best, seconds_since(t0));
  }
  std::printf("gemm %d x %d x %d, K blocks of %d, operands %s: %.3f ms, %.0f GFLOP/s\n", M, N, K, kb, which.c_str(),
              best * 1e3, 2.0 * M * N * K / best / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "usage: %s stream|tiles2|tiles4|linear|overlap|gemm [ROWS] [ahead]; needs AMX\n", argv[0]);
    return 1;
  }
  const std::string mode = argv[1];
  if (mode == "gemm") return gemm_main(argc, argv);
  if (mode == "overlap") {
    const int products = (argc > 2 ? std::atoi(argv[2]) : 64) / 16;
    const size_t bytes = size_t{1} << 30;
    char* buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(buf, 1, bytes);
    double alone = 0, tiles = 0, both = 0;
    for (int rep = 0; rep < 4; ++rep) {
      alone = std::max(alone, overlap_gbs(buf, bytes, 0, true));
      tiles = std::max(tiles, overlap_gbs(buf, bytes, products, false));
      both = std::max(both, overlap_gbs(buf, bytes, products, true));
    }
    std::printf("%d products a KB: stream %.1f GB/s, products %.1f, both %.1f (overlapped: %.1f, in turn: %.1f)\n",
                products, alone, tiles, both, std::min(alone, tiles), 1 / (1 / alone + 1 / tiles));
    return 0;
  }
  if (mode != "linear") {
    const int ahead = argc > 2 ? std::atoi(argv[2]) : 0, products = mode == "stream" ? 0 : mode == "tiles2" ? 2 : 4;
    const size_t bytes = size_t{1} << 30;
    char* buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(buf, 1, bytes);
    double best = 0;
    for (int rep = 0; rep < 4; ++rep) best = std::max(best, stream_gbs(buf, bytes, products, ahead));
    std::printf("%s, prefetch %d B ahead: %.1f GB/s\n", mode.c_str(), ahead, best);
    return 0;
  }
  const int M = argc > 2 ? std::atoi(argv[2]) : 64, ahead = argc > 3 ? std::atoi(argv[3]) : 0;
  const int shapes[4][2] = {{896, 1152}, {896, 896}, {896, 9728}, {4864, 896}};  // the default model's (K, N)
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  for (int i = 0; i < 4; ++i) {
    const int K = shapes[i][0], N = shapes[i][1];
    const size_t weights = static_cast<size_t>(N) * K;
    const int copies = static_cast<int>(std::max<size_t>(2, 400'000'000 / (weights * 2)));  // past the L3
    std::vector<std::vector<uint16_t>> tiles(copies, std::vector<uint16_t>(weights, 0x3c00));
    std::vector<uint16_t> x(static_cast<size_t>(64) * K, 0x3c00);
    std::vector<float> y(static_cast<size_t>(64) * N);
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& w : tiles) linear(x.data(), w.data(), y.data(), M, N, K, ahead);
      best = std::min(best, seconds_since(t0) / copies);
    }
    std::printf("%d rows, %s: %.3f ms, %.1f GB/s of weights\n", M, names[i], best * 1e3, weights * 2 / best / 1e9);
  }
  return 0;
}
