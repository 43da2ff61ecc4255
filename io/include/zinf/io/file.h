// File: a move-only owner of a file descriptor opened for direct I/O.
//
// open() asks for O_DIRECT and learns the alignment direct I/O needs on this file (statx
// STATX_DIOALIGN where the kernel reports it, else 4096). Where the file system refuses O_DIRECT
// the file is reopened buffered and one warning names the path; alignment() then reports 1.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "zinf/core/status.h"

namespace zinf::io {

struct FileOptions {
  bool create = false;     // O_CREAT
  bool exclusive = false;  // O_EXCL (with create): fail if the path exists
  bool read_only = false;
  bool direct = true;     // ask for O_DIRECT (fall back to buffered where refused)
  bool no_follow = true;  // O_NOFOLLOW: never open through a symlink
  mode_t mode = 0600;     // permissions of a created file
};

class File {
 public:
  static Result<File> open(const std::string& path, const FileOptions& options);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  // Buffers must start at a multiple of mem_alignment(); offsets and lengths must be multiples
  // of offset_alignment(). Both are 1 for a buffered file.
  uint32_t mem_alignment() const { return mem_align_; }
  uint32_t offset_alignment() const { return offset_align_; }

  // Reserves [offset, offset+length) on disk (fallocate). ENOSPC becomes ErrorCode::kNoSpace.
  Status preallocate(uint64_t offset, uint64_t length);
  Result<uint64_t> size() const;
  Status sync();
  Status close();

 private:
  File(int fd, std::string path, bool direct, uint32_t mem_align, uint32_t offset_align)
      : fd_(fd),
        path_(std::move(path)),
        direct_(direct),
        mem_align_(mem_align),
        offset_align_(offset_align) {}

  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
  uint32_t mem_align_ = 1;
  uint32_t offset_align_ = 1;
};

}  // namespace zinf::io
