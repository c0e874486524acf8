// How an int8_linear call is cut into parallel tasks: runs of consecutive weight tiles, and, where those are too
// few for the threads, blocks of rows of x as well.
//
// Tiles alone cap the threads a layer can use at its tile runs: a 896-wide output (the 0.5B model's down and o
// projections) is 56 tiles, 14 runs of 4, so on a 32- or 64-core server at most 14 cores worked on those layers
// (a third of a layer's multiply-adds) while the rest waited. Shorter runs come first, as they cost nothing but
// claims; then rows, whose blocks each read (and, in 5 bits, widen) the run's weights again.
#pragma once

#include "index_math.h"
#include "int8_layout.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace qb {

struct Int8Tasks {
  int64_t tiles_per_task;  // consecutive 16-row tiles of W a task owns
  int64_t tile_runs;       // ceil(tiles / tiles_per_task)
  int64_t rows_per_block;  // rows of x a task owns: all of them, or a multiple of 4 (the row kernels' block) ...
  int64_t row_blocks;      // ... in floor(M / rows_per_block) blocks, the last one taking the remainder too

  int64_t count() const { return tile_runs * row_blocks; }
  // Rows [first, second) of block b of an M-row call.
  std::pair<int64_t, int64_t> rows_of(int64_t b, int64_t M) const {
    return {b * rows_per_block, b + 1 == row_blocks ? M : (b + 1) * rows_per_block};
  }
};

constexpr int64_t kTilesPerTask = 4;  // the longest run; at one to eight rows a run streams its weights in order
// Tasks wanted per thread: the claims hand out shrinking runs of tasks, and balance only with several to hand out.
constexpr int64_t kTasksPerThread = 4;
// Rows of a block, at the least: fewer would read the weights once for too little arithmetic.
constexpr int64_t kMinBlockRows = 16;
// Multiply-adds of a task, at the least, for a cut to be worth a thread's wake-up (a few microseconds): a 64-wide
// layer's one-row call (2 us) took 2.2x as long cut in four (benchmarks/split_work_ab.py, Zen 5).
constexpr int64_t kMinTaskMacs = int64_t{1} << 16;

// The tasks of an M-row call with K inputs on `tiles` tiles with `threads` threads. Decode steps (at most 8 rows)
// may go down to one tile a task; more rows keep two, the least the AVX-512 kernel's widest tile block takes. One
// thread, or nothing to multiply, keeps the longest runs and all rows in one block.
inline Int8Tasks int8_tasks(int64_t M, int64_t K, int64_t tiles, int64_t threads) {
  const int64_t all_rows = std::max<int64_t>(M, 1), tile_macs = kTileRows * K;
  const Int8Tasks uncut{kTilesPerTask, ceil_div(tiles, kTilesPerTask), all_rows, 1};
  if (threads <= 1 || tiles == 0 || K == 0) return uncut;
  const int64_t wanted = kTasksPerThread * threads;
  const int64_t fewest_tiles = M <= 8 ? 1 : 2;
  int64_t per = kTilesPerTask;
  while (per > fewest_tiles && ceil_div(tiles, per) < wanted && per / 2 * tile_macs * all_rows >= kMinTaskMacs)
    per /= 2;
  const int64_t runs = ceil_div(tiles, per);
  int64_t rows = all_rows, blocks = 1;
  if (runs < wanted && M >= 2 * kMinBlockRows) {
    const int64_t least_rows = std::max(kMinBlockRows, ceil_div(kMinTaskMacs, per * tile_macs));
    const int64_t most_blocks = std::max<int64_t>(1, std::min(ceil_div(wanted, runs), M / least_rows));
    // Whole 4-row blocks of at least least_rows each; the remainder goes to the last block, never a short one.
    rows = ceil_div(std::max(least_rows, ceil_div(M, most_blocks)), 4) * 4;
    blocks = std::max<int64_t>(1, M / rows);
  }
  return {per, runs, rows, blocks};
}

}  // namespace qb
