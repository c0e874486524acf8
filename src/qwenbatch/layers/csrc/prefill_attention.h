// The prefill attention kernels' shared problem: one call's tensors, and the float32 kernel's entry (its bf16 twin is
// in prefill_attention.cpp, which also holds the checked entry point both share).
#pragma once

#include <cstdint>

namespace qb {

// One call's tensors: q [Lq, heads, d], k and v [Lk, kv_heads, d] (rows `*_row` elements apart, heads `*_head`),
// or, with `slots`, key i's K and V in row slots[i] of k and v (a paged cache's slots); out [Lq, heads, d]
// contiguous. Query i sees keys 0 ..= i + Lk - Lq.
template <typename T>
struct PrefillProblem {
  const T *q, *k, *v;
  T* out;
  int64_t q_len, k_len, heads, kv_heads, head_dim;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  float scale;
  const int64_t* slots = nullptr;

  int64_t row_of(int64_t key) const { return slots ? slots[key] : key; }
};

// Whether prefill_attention_f32.cpp was built (it needs AVX2 and FMA), and its kernel: head_dim a multiple of 16.
bool prefill_attention_f32_built();
void prefill_attention_f32(const PrefillProblem<float>& pr);

}  // namespace qb
