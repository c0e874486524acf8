// Integer helpers the kernels share for cutting work into blocks.
#pragma once

#include <cstdint>

namespace qb {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t x, int64_t to) { return ceil_div(x, to) * to; }

}  // namespace qb
