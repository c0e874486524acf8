// Software prefetches that the compiler keeps.
//
// GCC 12 drops __builtin_prefetch (and _mm_prefetch, which is built on it) as dead code in some loops: the decode
// attention's prefetch of the next KV block was never emitted, and the int8 kernel lost every weight-stream
// prefetch when one sat behind a branch. An asm volatile statement is never removed, so each of these is issued.
#pragma once

namespace qb {

// Asks for the cache line holding p into L1 (and L2).
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

// Asks for the cache line holding p into L2.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

}  // namespace qb
