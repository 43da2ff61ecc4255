// AlignedBuffer: a move-only, page-aligned host allocation for direct I/O (tests, benchmarks,
// staging). Pinned, registered buffers for the runtime come from memory/PinnedPool.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <utility>

namespace zinf::io {

class AlignedBuffer {
 public:
  static constexpr size_t kDefaultAlignment = 4096;
  static constexpr size_t kHugePage = size_t{2} << 20;

  AlignedBuffer() = default;
  // With an alignment of kHugePage or more, the buffer asks for transparent huge pages
  // (MADV_HUGEPAGE; the system may still give small ones): direct I/O into it then needs far
  // fewer segments per request.
  explicit AlignedBuffer(size_t bytes, size_t alignment = kDefaultAlignment) : size_(bytes) {
    if (bytes == 0) return;
    size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    data_ = static_cast<std::byte*>(std::aligned_alloc(alignment, rounded));
    if (data_ == nullptr) {
      size_ = 0;
      return;
    }
    if (alignment >= kHugePage) (void)::madvise(data_, rounded, MADV_HUGEPAGE);
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  // False when the allocation failed (or size 0).
  explicit operator bool() const { return data_ != nullptr; }
  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace zinf::io
