// PinnedPool: page-aligned host buffers for staging and for host-resident state.
//
//  - Buffers are page-aligned, mlock'd where allowed (cudaHostAlloc under CUDA later). If
//    pinning fails (RLIMIT_MEMLOCK, no privilege) the pool says so once, loudly, and carries on
//    with pageable memory: everything still works, only slower.
//  - Each new allocation is registered once with the IoEngine (when one is given) so NVMe reads
//    and writes into it use io_uring fixed buffers; freed buffers are kept for reuse by requests
//    of the same size and only released (unregistered, unlocked, freed) when the budget needs
//    the room or the pool is destroyed.
//  - The budget covers buffers in use plus cached ones; exceeding it is ErrorCode::kOutOfMemory
//    naming the request and the budget. In-use bytes are accounted in the Ledger (Tier::kHost)
//    by category, cached bytes as kBuffers.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/io/io_engine.h"
#include "zinf/memory/accounting.h"

namespace zinf {

class Device;
class PinnedPool;

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  void reset();
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class PinnedPool;
  PinnedBuffer(PinnedPool* pool, void* data, uint64_t bytes, MemoryCategory category)
      : pool_(pool), data_(data), bytes_(bytes), category_(category) {}
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::kBuffers;
};

struct PinnedPoolOptions {
  uint64_t budget_bytes = 1ull << 30;
  bool pin = true;  // mlock (falls back to pageable memory when refused)
  // Buffers of category kBuffers (staging, scratch) are registered with it for fixed-buffer
  // I/O; tensors' copies are not (pinned_pool.cc says why).
  io::IoEngine* engine = nullptr;
  Ledger* ledger = nullptr;  // Tier::kHost accounting; may be null
  // The device whose operations use these buffers: each is registered with it (CUDA: pinned and
  // mapped for its kernels) for as long as it is mapped; may be null.
  Device* device = nullptr;
};

struct PinnedPoolStats {
  uint64_t bytes_in_use = 0;
  uint64_t bytes_cached = 0;
  uint64_t allocations = 0;  // fresh allocations from the system
  uint64_t reuses = 0;       // requests served from the cache
  uint64_t registered = 0;   // buffers currently registered with the IoEngine
  bool pinned = true;        // false once pinning was refused
};

class PinnedPool {
 public:
  explicit PinnedPool(const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Rounds up to 4 KiB. The contents of a reused buffer are whatever was there before.
  Result<PinnedBuffer> allocate(uint64_t bytes, MemoryCategory category);
  // Frees every cached buffer.
  void trim();

  PinnedPoolStats stats() const;
  uint64_t budget_bytes() const { return options_.budget_bytes; }

 private:
  friend class PinnedBuffer;
  struct Block {
    void* data;
    uint64_t bytes;
    bool locked;
    int io_slot;  // -1: not registered
    bool device_registered;
  };
  void give_back(void* data, uint64_t bytes, MemoryCategory category);
  void destroy(const Block& b);
  // Frees cached blocks until `needed` more bytes fit; caller holds mu_.
  bool make_room(uint64_t needed);

  PinnedPoolOptions options_;
  mutable std::mutex mu_;
  std::multimap<uint64_t, Block> cache_;  // size -> free block
  std::map<void*, Block> live_;           // data -> block handed out
  PinnedPoolStats stats_;
};

}  // namespace zinf
