// A CPU allocator for PyTorch that keeps large freed buffers for reuse (layers/host_allocator.py says when it is
// installed, and why).
//
// PyTorch's default CPU allocator is malloc: glibc serves each buffer above 32 MiB with a fresh mmap and unmaps it
// when freed, and in a thread's own arena (the engine's thread in a server or a run-batch job) every buffer above
// its heap's size too. A prefill chunk's activations are such buffers, so each chunk of each layer faulted its
// pages in again and the kernel zeroed them. Here a buffer of at least kLargeBytes (32 MiB) is a mapping of whole
// 2 MiB huge pages (advised for transparent huge pages) which, once freed, waits in a cache for the next buffer of
// about its size, or is grown into a larger one. Smaller buffers go to malloc as before.
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

#include "ops.h"

namespace {

// glibc's own threshold for mapping a buffer rather than serving it from its heap, at its highest (it rises to it
// as buffers are freed): below it malloc reuses memory well, sizes changing step by step included (a cache of exact
// sizes made transformers' growing KV tensors 20% slower); above it each buffer was a fresh mapping.
constexpr size_t kLargeBytes = size_t{32} << 20;
constexpr size_t kHugePage = size_t{2} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// An anonymous mapping of `bytes` (a multiple of kHugePage) starting on a huge-page boundary, or nullptr.
void* map_huge_aligned(size_t bytes) {
  void* region = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(region);
  const uintptr_t aligned = round_up(start, kHugePage);
  if (aligned > start) munmap(region, aligned - start);
  const uintptr_t end = start + bytes + kHugePage;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - (aligned + bytes));
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // refused without THP: plain pages then
  return reinterpret_cast<void*>(aligned);
}

// `old` (a mapping of old_bytes) moved to the start of a new mapping of `bytes` > old_bytes, or nullptr (and `old`
// untouched). Its pages move with it, so only the new tail faults in when written; mremap moves whole page-table
// entries, huge pages included, where both ends are huge-page aligned, as ours are.
void* grow_mapping(void* old, size_t old_bytes, size_t bytes) {
  void* region = map_huge_aligned(bytes);
  if (region == nullptr) return nullptr;
  if (mremap(old, old_bytes, old_bytes, MREMAP_MAYMOVE | MREMAP_FIXED, region) == MAP_FAILED) {
    munmap(region, bytes);
    return nullptr;
  }
  return region;
}

class StepBufferAllocator final : public c10::Allocator {
 public:
  // A small buffer is malloc's and frees as malloc's: only large ones pay for the lock and lookup in release.
  c10::DataPtr allocate(size_t n) override {
    if (n < kLargeBytes) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
    }
    void* p = take(round_up(n, kHugePage));
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_cache_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    cache_limit_ = bytes;
  }

  // Unmaps every cached buffer.
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [bytes, p] : cached_) munmap(p, bytes);
    cached_.clear();
    cached_bytes_ = 0;
  }

  std::tuple<int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t live = 0;
    for (const auto& entry : live_) live += entry.second;
    return {static_cast<int64_t>(live), static_cast<int64_t>(cached_bytes_)};
  }

  // Never destroyed: tensors are still freed while the process exits.
  static StepBufferAllocator& instance() {
    static auto* allocator = new StepBufferAllocator();
    return *allocator;
  }

 private:
  // A cached buffer of at least `bytes` and at most a quarter more; else the largest smaller one, grown to `bytes`;
  // else a new mapping. Growing serves buffers whose size creeps up step by step: the LM head's logits in the steps
  // that prefill while more and more sequences decode (151,936 logits a row, 139, 161, 183 ... sampled rows) were
  // each a new mapping whose 2 MiB pages all faulted in, 50-110 ms a step on 20-30 ms of arithmetic (AMX kind).
  void* take(size_t bytes) {
    void* smaller = nullptr;
    size_t smaller_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = cached_.lower_bound(bytes);
      if (it != cached_.end() && it->first <= bytes + bytes / 4) {
        void* p = it->second;
        live_[p] = it->first;
        cached_bytes_ -= it->first;
        cached_.erase(it);
        return p;
      }
      if (it != cached_.begin()) {
        --it;
        smaller = it->second, smaller_bytes = it->first;
        cached_bytes_ -= it->first;
        cached_.erase(it);
      }
    }
    void* p = smaller == nullptr ? nullptr : grow_mapping(smaller, smaller_bytes, bytes);
    if (smaller != nullptr && p == nullptr) munmap(smaller, smaller_bytes);
    if (p == nullptr) p = map_huge_aligned(bytes);
    if (p == nullptr) {
      empty_cache();  // the cache may hold what the system lacks
      p = map_huge_aligned(bytes);
      TORCH_CHECK(p != nullptr, "out of memory: could not map a CPU buffer of ", bytes, " bytes");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    live_[p] = bytes;
    return p;
  }

  // Frees a buffer of either kind (raw_deallocate sends small ones here too): a mapping of ours goes to the cache,
  // or is unmapped past the cache's limit.
  static void release(void* p) {
    if (p == nullptr) return;
    StepBufferAllocator& self = instance();
    std::unique_lock<std::mutex> lock(self.mutex_);
    auto it = self.live_.find(p);
    if (it == self.live_.end()) {
      lock.unlock();
      c10::free_cpu(p);
      return;
    }
    const size_t bytes = it->second;
    self.live_.erase(it);
    if (self.cached_bytes_ + bytes > self.cache_limit_) {
      lock.unlock();
      munmap(p, bytes);
      return;
    }
    self.cached_.emplace(bytes, p);
    self.cached_bytes_ += bytes;
  }

  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;  // our mappings in use, and their sizes
  std::multimap<size_t, void*> cached_;     // freed mappings by size
  size_t cached_bytes_ = 0;
  size_t cache_limit_ = size_t{1} << 30;
};

}  // namespace

void install_step_buffer_allocator(int64_t cache_limit_bytes) {
  StepBufferAllocator& allocator = StepBufferAllocator::instance();
  allocator.set_cache_limit(static_cast<size_t>(cache_limit_bytes));
  c10::SetCPUAllocator(&allocator, /*priority=*/1);
}

void empty_step_buffer_cache() { StepBufferAllocator::instance().empty_cache(); }

std::tuple<int64_t, int64_t> step_buffer_stats() { return StepBufferAllocator::instance().stats(); }
