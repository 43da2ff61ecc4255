// The budgeted block cache of a device allocator (CpuDevice, CudaDevice). A freed block is kept
// and reused by the next request of its size, with no call into the system (fresh CPU pages cost
// a page fault each on first touch; cudaFree synchronises the whole GPU). Blocks in use and
// cached ones share the byte budget: a request of a new size drops cached blocks, largest first,
// until it fits. The cache only counts; the device maps and frees the blocks, outside its lock.
// The engine releases a buffer only once the operations using it have completed (the device
// contract), so a reused block is never still in use.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "budget_error.h"
#include "zinf/core/status.h"
#include "zinf/memory/accounting.h"

namespace zinf {

class BlockCache {
 public:
  struct Block {
    void* data = nullptr;
    uint64_t bytes = 0;
  };
  struct Reservation {
    void* reused = nullptr;      // a cached block of the requested size; null: allocate one
    std::vector<Block> evicted;  // cached blocks dropped to make room: the caller frees them
  };

  explicit BlockCache(uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}

  // Counts `padded` bytes as in use: a cached block of exactly that size when there is one, else
  // room under the budget. kOutOfMemory (naming `requested` and `category`) when the blocks in
  // use leave no room; nothing is evicted then.
  Result<Reservation> reserve(uint64_t padded, uint64_t requested, MemoryCategory category) {
    std::lock_guard lock(mu_);
    Reservation r;
    if (auto it = cache_.find(padded); it != cache_.end()) {
      r.reused = it->second;
      cache_.erase(it);
      cached_ -= padded;
    } else {
      if (in_use_ + padded > budget_bytes_) {
        return device_budget_exhausted(requested, category, in_use_, budget_bytes_);
      }
      while (in_use_ + cached_ + padded > budget_bytes_ && !cache_.empty()) {
        auto last = std::prev(cache_.end());
        r.evicted.push_back({last->second, last->first});
        cached_ -= last->first;
        cache_.erase(last);
      }
    }
    in_use_ += padded;
    return r;
  }

  // Gives back a reservation whose allocation failed.
  void unreserve(uint64_t padded) {
    std::lock_guard lock(mu_);
    in_use_ -= padded;
  }

  // A released block: no longer in use, kept for reuse.
  void release(void* data, uint64_t padded) {
    std::lock_guard lock(mu_);
    in_use_ -= padded;
    cache_.emplace(padded, data);
    cached_ += padded;
  }

  uint64_t in_use() const {
    std::lock_guard lock(mu_);
    return in_use_;
  }

  // Every cached block, handed to the caller to free (the device's destructor).
  std::vector<Block> drain() {
    std::lock_guard lock(mu_);
    std::vector<Block> blocks;
    for (auto& [bytes, data] : cache_) blocks.push_back({data, bytes});
    cache_.clear();
    cached_ = 0;
    return blocks;
  }

 private:
  const uint64_t budget_bytes_;
  mutable std::mutex mu_;
  uint64_t in_use_ = 0;
  uint64_t cached_ = 0;
  std::multimap<uint64_t, void*> cache_;  // size -> freed block kept for reuse
};

}  // namespace zinf
