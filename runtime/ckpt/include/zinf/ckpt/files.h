// Shard files of a checkpoint, written and read in order with an XXH3-64 checksum computed as
// the bytes pass (never a second pass over the data on save).
//
// Contract
//  - ShardWriter creates its file fresh (O_EXCL, O_NOFOLLOW, mode 0600) and appends, with direct
//    I/O while the writes are whole 4 KiB-aligned blocks (buffered I/O from the first that is not,
//    or where the file system refuses O_DIRECT). finish()
//    fsyncs and closes it and returns its size and checksum; a writer dropped unfinished closes
//    its file and leaves it to the caller's temporary directory, which is removed on failure.
//  - ShardReader::open() refuses a file whose size differs from the manifest's (a truncated
//    shard) and reads at any offset (pread), so a loader can take the parts it needs.
//  - verify_file() reads a whole file through one bounded buffer and compares size and checksum.
//  - Every error names the file, and the offset and length where one applies.
#pragma once

#include <cstdint>
#include <string>

#include "zinf/core/status.h"

namespace zinf::ckpt {

// A file of the checkpoint as the manifest records it.
struct FileDigest {
  std::string name;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;  // XXH3-64 of the whole file, seed 0
};

class ShardWriter {
 public:
  static Result<ShardWriter> create(const std::string& dir, const std::string& name);
  ShardWriter() = default;
  ShardWriter(ShardWriter&& o) noexcept;
  ShardWriter& operator=(ShardWriter&& o) noexcept;
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  ~ShardWriter();

  // Appends `bytes` bytes (short writes continued, EINTR retried).
  Status write(const void* data, uint64_t bytes);
  uint64_t offset() const { return offset_; }
  const std::string& path() const { return path_; }
  // fsync and close: the file's digest.
  Result<FileDigest> finish();

 private:
  void close_fd();
  int fd_ = -1;
  std::string name_, path_;
  uint64_t offset_ = 0;
  bool direct_ = false;   // O_DIRECT (until a write that is not whole aligned blocks)
  void* hash_ = nullptr;  // XXH3_state_t
};

class ShardReader {
 public:
  // Opens `dir/expected.name` and checks its size against the manifest.
  static Result<ShardReader> open(const std::string& dir, const FileDigest& expected);
  ShardReader() = default;
  ShardReader(ShardReader&& o) noexcept;
  ShardReader& operator=(ShardReader&& o) noexcept;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;
  ~ShardReader();

  // Reads exactly `bytes` at `offset`; past the end of the file is an error naming both.
  Status read_at(uint64_t offset, void* data, uint64_t bytes) const;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
  uint64_t bytes_ = 0;
};

// Reads `dir/expected.name` whole through a buffer of `buffer_bytes` and checks its size and
// XXH3: kCorrupt naming the file on a mismatch, kNotFound when it is missing.
Status verify_file(const std::string& dir, const FileDigest& expected,
                   uint64_t buffer_bytes = 4ull << 20);

// XXH3-64 of a buffer (the manifest's checksum of small files).
uint64_t xxh3(const void* data, uint64_t bytes);

// Writes `text` to `dir/name` (created fresh, 0600) and fsyncs it.
Result<FileDigest> write_small_file(const std::string& dir, const std::string& name,
                                    const std::string& text);
// The whole of a small file (a manifest, the `latest` pointer).
Result<std::string> read_small_file(const std::string& path);

}  // namespace zinf::ckpt
