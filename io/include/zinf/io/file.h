// File: a move-only owner of a file descriptor opened for direct I/O.
//
// open() opens (or creates) the file without O_DIRECT, then turns O_DIRECT on with
// fcntl(F_SETFL) and learns the alignment direct I/O needs on this file (statx STATX_DIOALIGN
// where the kernel reports it, else 4096). Where the file system refuses O_DIRECT (EINVAL) the
// same descriptor stays buffered and one warning names the path; alignment() then reports 1.
// Opening in two steps is what keeps O_EXCL whole: some file systems create the file before
// refusing open(O_DIRECT), and a second, buffered open(O_CREAT|O_EXCL) then fails with EEXIST
// and leaves the file behind. A file open() created is removed again on every failure path.
//
// DirHandle: a move-only owner of a directory descriptor. open_at() and the swap space's run
// directories work relative to one, so a path component replaced by a symlink after the
// directory was opened cannot redirect what is created or removed in it.
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

class DirHandle {
 public:
  // Opens `path` as a directory (O_DIRECTORY; with `no_follow`, refusing a symlink as the last
  // component). An error names the path.
  static Result<DirHandle> open(const std::string& path, bool no_follow = false);
  // Opens `name` inside `parent` (O_DIRECTORY | O_NOFOLLOW); the path is parent's + "/" + name.
  static Result<DirHandle> open_at(const DirHandle& parent, const std::string& name);

  DirHandle() = default;
  DirHandle(DirHandle&& other) noexcept;
  DirHandle& operator=(DirHandle&& other) noexcept;
  DirHandle(const DirHandle&) = delete;
  DirHandle& operator=(const DirHandle&) = delete;
  ~DirHandle();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  DirHandle(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

class File {
 public:
  static Result<File> open(const std::string& path, const FileOptions& options);
  // `name` relative to `dir` (openat); path() is dir.path() + "/" + name.
  static Result<File> open_at(const DirHandle& dir, const std::string& name,
                              const FileOptions& options);

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
  // `name` relative to dir_fd (AT_FDCWD for a plain path); `path` names it in messages.
  static Result<File> open_relative(int dir_fd, const std::string& name, std::string path,
                                    const FileOptions& options);
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
