#include "zinf/memory/pinned_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/memory/device.h"

namespace zinf {

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

void PinnedBuffer::reset() {
  if (data_ != nullptr) pool_->give_back(data_, bytes_, category_);
  pool_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

PinnedPool::PinnedPool(const PinnedPoolOptions& options) : options_(options) {
  stats_.pinned = options.pin;
}

PinnedPool::~PinnedPool() {
  std::lock_guard lock(mu_);
  ZINF_CHECK(live_.empty(), "PinnedPool destroyed with {} buffers still in use", live_.size());
  for (auto& [size, block] : cache_) destroy(block);
  if (options_.ledger && stats_.bytes_cached) {
    options_.ledger->sub(Tier::kHost, MemoryCategory::kBuffers, stats_.bytes_cached);
  }
  cache_.clear();
}

void PinnedPool::destroy(const Block& b) {
  if (b.io_slot >= 0 && options_.engine) (void)options_.engine->unregister_buffer(b.io_slot);
  if (b.io_slot >= 0) --stats_.registered;
  if (b.device_registered) options_.device->unregister_host(b.data);
  if (b.locked) ::munlock(b.data, b.bytes);
  ::munmap(b.data, b.bytes);
}

bool PinnedPool::make_room(uint64_t needed) {
  while (stats_.bytes_in_use + stats_.bytes_cached + needed > options_.budget_bytes) {
    if (cache_.empty()) return false;
    auto it = std::prev(cache_.end());  // the largest cached block frees the most
    destroy(it->second);
    stats_.bytes_cached -= it->first;
    if (options_.ledger) options_.ledger->sub(Tier::kHost, MemoryCategory::kBuffers, it->first);
    cache_.erase(it);
  }
  return true;
}

Result<PinnedBuffer> PinnedPool::allocate(uint64_t bytes, MemoryCategory category) {
  if (bytes == 0) return PinnedBuffer();
  uint64_t padded = align_up(bytes, 4096);
  std::lock_guard lock(mu_);
  if (auto it = cache_.find(padded); it != cache_.end()) {
    Block b = it->second;
    cache_.erase(it);
    stats_.bytes_cached -= padded;
    stats_.bytes_in_use += padded;
    ++stats_.reuses;
    live_.emplace(b.data, b);
    if (options_.ledger) {
      options_.ledger->sub(Tier::kHost, MemoryCategory::kBuffers, padded);
      options_.ledger->add(Tier::kHost, category, padded);
    }
    return PinnedBuffer(this, b.data, padded, category);
  }
  if (!make_room(padded)) {
    return make_error(ErrorCode::kOutOfMemory,
                      "host budget exhausted: {} requested for {} while {} of the {} budget is in "
                      "use",
                      format_bytes(static_cast<double>(padded)), category_name(category),
                      format_bytes(static_cast<double>(stats_.bytes_in_use)),
                      format_bytes(static_cast<double>(options_.budget_bytes)));
  }
  // Mapped, not malloc'd: a freed buffer goes back to the system at once (glibc would keep
  // blocks below its sliding mmap threshold in its arenas, and the process's RSS with them).
  // Buffers of 2 MiB or more start on a 2 MiB boundary (mapped 2 MiB larger, the ends unmapped)
  // and ask for transparent huge pages: a direct read or write into 4 KiB pages needs a segment
  // per page, and past the disk's segment limit (254 on a virtio disk) the block layer splits
  // each 1 MiB request in two and cannot merge neighbours (docs/io.md).
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  const bool huge = padded >= kHuge;
  const uint64_t mapped = huge ? padded + kHuge : padded;
  void* raw = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return make_error(ErrorCode::kOutOfMemory, "the system refused {} of host memory",
                      format_bytes(static_cast<double>(padded)));
  }
  void* data = raw;
  if (huge) {
    auto* base = static_cast<std::byte*>(raw);
    auto* start = reinterpret_cast<std::byte*>(align_up(reinterpret_cast<uintptr_t>(base), kHuge));
    if (start > base) ::munmap(base, static_cast<size_t>(start - base));
    std::byte* end = start + padded;
    if (base + mapped > end) ::munmap(end, static_cast<size_t>(base + mapped - end));
    data = start;
    (void)::madvise(data, padded, MADV_HUGEPAGE);
  }
  Block b{data, padded, false, -1, false};
  if (options_.device != nullptr) {
    if (Status s = options_.device->register_host(data, padded); !s.is_ok()) {
      ::munmap(data, padded);
      return make_error(ErrorCode::kOutOfMemory, "registering {} of host memory with device {}: {}",
                        format_bytes(static_cast<double>(padded)), options_.device->name(),
                        s.message());
    }
    b.device_registered = true;
  }
  if (options_.pin && stats_.pinned) {
    if (::mlock(data, padded) == 0) {
      b.locked = true;
    } else {
      int err = errno;
      stats_.pinned = false;
      log::warn_once("pinned-pool:mlock",
                     fmt::format("cannot pin host memory ({}): using pageable memory; raise "
                                 "`ulimit -l` or run with CAP_IPC_LOCK for full copy speed",
                                 std::strerror(err)));
    }
  }
  // Only buffers (staging, scratch) are registered for fixed-buffer I/O: they serve transfer
  // after transfer. A tensor's copy serves one or two per residency, and registering it would
  // pin every page on the ring's thread, which meanwhile submits and reaps nothing (in the 2 B
  // step of bench/beyond_ram.sh the rings' threads spent an eighth of the CPU time so and the
  // step took 1.4x as long; docs/io.md). Unregistered, a direct request pins its own pages.
  if (options_.engine && category == MemoryCategory::kBuffers) {
    auto slot = options_.engine->register_buffer(data, padded);
    if (slot.is_ok()) {
      b.io_slot = *slot;
      ++stats_.registered;
    }
  }
  ++stats_.allocations;
  stats_.bytes_in_use += padded;
  live_.emplace(data, b);
  if (options_.ledger) options_.ledger->add(Tier::kHost, category, padded);
  return PinnedBuffer(this, data, padded, category);
}

void PinnedPool::give_back(void* data, uint64_t bytes, MemoryCategory category) {
  std::lock_guard lock(mu_);
  auto it = live_.find(data);
  ZINF_CHECK(it != live_.end(), "buffer {} was not allocated by this pool", data);
  Block b = it->second;
  live_.erase(it);
  stats_.bytes_in_use -= bytes;
  stats_.bytes_cached += bytes;
  cache_.emplace(bytes, b);
  if (options_.ledger) {
    options_.ledger->sub(Tier::kHost, category, bytes);
    options_.ledger->add(Tier::kHost, MemoryCategory::kBuffers, bytes);
  }
}

void PinnedPool::trim() {
  std::lock_guard lock(mu_);
  make_room(options_.budget_bytes + 1);  // frees every cached block (cannot succeed)
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace zinf
