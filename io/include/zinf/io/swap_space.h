// SwapSpace: extents of bytes on one or more NVMe paths, for tensors that do not fit in memory.
//
//  - Each directory (one per drive) gets a private run directory `zinf-<pid>-<host>-<random>`
//    (<host>: swap_host_tag(), which says where <pid> means something; 0700,
//    owned by this user, held open: DirHandle) holding a few large preallocated files (0600,
//    created relative to the run directory's descriptor with O_EXCL|O_NOFOLLOW), grown by whole
//    files of `file_bytes` as extents are allocated. Everything is removed when the SwapSpace is
//    destroyed (clean shutdown), and whatever a failed create() or allocate() made is removed
//    before it returns.
//  - An extent is striped over the directories (a piece on each, 4 KiB aligned) when it is at
//    least `stripe_min_bytes` per directory, so one tensor read uses every drive.
//  - Extent sizes are rounded up to 4 KiB: read()/write() move padded_bytes(), and buffers must
//    be that large and 4 KiB aligned.
//  - With `checksum` on, writes record an XXH3-64 of every 1 MiB block of the extent and reads
//    verify the blocks they cover: a mismatch is ErrorCode::kCorrupt naming the extent and the
//    offset. Range transfers then start and end on 1 MiB blocks (or at the extent's end).
//  - All methods are thread-safe. I/O goes through the IoEngine given at creation, which must
//    outlive the SwapSpace.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/io/io_engine.h"

namespace zinf::io {

// Eight hex digits naming the machine boot and pid namespace this process runs in (a hash of
// /proc/sys/kernel/random/boot_id and the /proc/self/ns/pid link): a pid in a run directory's
// name is only meaningful to a process with the same tag. "" when either cannot be read.
std::string swap_host_tag();

struct SwapSpaceOptions {
  std::vector<std::string> directories;    // one per NVMe drive; must exist and be writable
  uint64_t file_bytes = 1ull << 30;        // preallocation unit of the swap files
  uint64_t stripe_min_bytes = 1ull << 20;  // stripe only extents of at least this per directory
  bool checksum = true;                    // XXH3-64 per 1 MiB block, verified on read
  bool direct = true;                      // O_DIRECT (falls back to buffered where refused)
};

using ExtentId = uint64_t;

struct SwapStats {
  uint64_t extents = 0;
  uint64_t bytes_allocated = 0;  // padded bytes held by live extents
  uint64_t bytes_reserved = 0;   // bytes preallocated in swap files
  uint64_t files = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
};

// A read's checksums, left to whoever waits for the read (SwapSpace::verify) instead of the I/O
// thread that completes it, so that the ring's one thread submits and reaps while the waiters
// hash. Empty when checksums are off.
class ReadCheck {
 public:
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class SwapSpace;
  struct Data;
  std::shared_ptr<const Data> data_;
};

class SwapSpace {
 public:
  static constexpr uint64_t kAlignment = 4096;
  static constexpr uint64_t kChecksumBlock = 1ull << 20;

  static Result<std::unique_ptr<SwapSpace>> create(IoEngine& engine, SwapSpaceOptions options);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Allocates an extent of at least `bytes` (rounded up to 4 KiB). `name` (e.g. the tensor it
  // holds) appears in errors about this extent. kNoSpace when a file cannot be grown.
  Result<ExtentId> allocate(uint64_t bytes, std::string name = {});
  Status free(ExtentId id);
  uint64_t padded_bytes(ExtentId id) const;

  // Asynchronous; `done` runs once on an I/O thread (must not block). The buffer must stay valid
  // until then. Errors name the extent, the file and the offset.
  Status write_async(ExtentId id, const void* buffer, std::function<void(Status)> done);
  Status read_async(ExtentId id, void* buffer, std::function<void(Status)> done);
  Status write(ExtentId id, const void* buffer);
  Status read(ExtentId id, void* buffer);
  // Part of an extent: [offset, offset+length), 4 KiB aligned; `buffer` holds just that range.
  Status write_range_async(ExtentId id, uint64_t offset, uint64_t length, const void* buffer,
                           std::function<void(Status)> done);
  Status read_range_async(ExtentId id, uint64_t offset, uint64_t length, void* buffer,
                          std::function<void(Status)> done);
  // The same, with the checksums checked by the caller: `check` is set before this returns, and
  // once `done` has reported success the bytes may be used only after verify(check) passes.
  Status read_range_async(ExtentId id, uint64_t offset, uint64_t length, void* buffer,
                          std::function<void(Status)> done, ReadCheck& check);
  // Hashes the blocks a finished read brought and compares them with the checksums they were
  // written with: kCorrupt naming the extent, its file and the block's offset on a mismatch.
  Status verify(const ReadCheck& check) const;
  Status write_range(ExtentId id, uint64_t offset, uint64_t length, const void* buffer);
  Status read_range(ExtentId id, uint64_t offset, uint64_t length, void* buffer);

  SwapStats stats() const;
  // The private run directories, one per configured directory.
  std::vector<std::string> run_directories() const;

  struct Impl;

 private:
  explicit SwapSpace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf::io
