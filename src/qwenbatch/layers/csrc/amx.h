// AMX tiles for the attention kernels: whether this process may use them, and the one tile shape they use.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QB_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace qb {

// Whether this process may use AMX tiles: Linux hands out their 8 KB of state only to processes that ask
// (ARCH_REQ_XCOMP_PERM for XTILEDATA); oneDNN asks too, but one of our kernels may run first.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// All eight tiles 16 rows of 64 bytes: a float32 C tile of 16 x 16, a bf16 A tile of 16 rows x 32 values, a B
// tile of 16 pairs x 16 columns.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Configures this thread's tiles (oneDNN reconfigures them for its own calls) and releases their state when done.
inline void configure_tiles() {
  static const TileConfig config;  // static: built at compile time (GCC 12 dropped stores to a stack copy)
  _tile_loadconfig(&config);
}

}  // namespace qb

#endif
