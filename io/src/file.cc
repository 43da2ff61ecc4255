#include "zinf/io/file.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "zinf/core/log.h"
#include "zinf/io/fault.h"

namespace zinf::io {
namespace {

constexpr uint32_t kFallbackAlignment = 4096;

// Alignment for direct I/O on fd: statx STATX_DIOALIGN where the kernel reports it (6.1+).
std::pair<uint32_t, uint32_t> dio_alignment(int fd) {
  struct statx stx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align != 0 &&
      stx.stx_dio_mem_align != 0) {
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align};
  }
  return {kFallbackAlignment, kFallbackAlignment};
}

}  // namespace

// See file.h for why O_DIRECT is set afterwards with F_SETFL.
Result<File> File::open_relative(int dir_fd, const std::string& name, std::string path,
                                 const FileOptions& options) {
  int flags = O_CLOEXEC | (options.read_only ? O_RDONLY : O_RDWR);
  if (options.no_follow) flags |= O_NOFOLLOW;
  // `created`: this call made the file, so this call removes it again if it fails. Without
  // O_EXCL asked for, O_EXCL first tells whether the file is new; an existing one is opened.
  bool created = false;
  int fd = -1;
  if (options.create) {
    fd = ::openat(dir_fd, name.c_str(), flags | O_CREAT | O_EXCL, options.mode);
    created = fd >= 0;
    if (fd < 0 && errno == EEXIST && !options.exclusive) {
      fd = ::openat(dir_fd, name.c_str(), flags, options.mode);
    }
  } else {
    fd = ::openat(dir_fd, name.c_str(), flags);
  }
  if (fd < 0) return errno_status(errno, fmt::format("cannot open {}", path));
  auto fail = [&](int err, std::string what) {
    ::close(fd);
    if (created && ::unlinkat(dir_fd, name.c_str(), 0) != 0) {
      log::warn("cannot remove {} after a failed open: {}", path, std::strerror(errno));
    }
    return errno_status(err, std::move(what));
  };

  bool direct = false;
  if (options.direct) {
    int rc = -1;
    if (FaultInjector::global().refuse_direct()) {
      errno = EINVAL;
    } else {
      int current = ::fcntl(fd, F_GETFL);
      rc = current < 0 ? -1 : ::fcntl(fd, F_SETFL, current | O_DIRECT);
    }
    if (rc == 0) {
      direct = true;
    } else if (errno == EINVAL) {
      // The file system refuses O_DIRECT (tmpfs on older kernels, some FUSE/network mounts).
      log::warn_once("odirect:" + path,
                     fmt::format("O_DIRECT refused for {}: falling back to buffered I/O "
                                 "(throughput will include the page cache)",
                                 path));
    } else {
      return fail(errno, fmt::format("cannot turn on O_DIRECT for {}", path));
    }
  }
  auto [mem_align, offset_align] = direct ? dio_alignment(fd) : std::pair<uint32_t, uint32_t>{1, 1};
  return File(fd, std::move(path), direct, mem_align, offset_align);
}

Result<File> File::open(const std::string& path, const FileOptions& options) {
  return open_relative(AT_FDCWD, path, path, options);
}

Result<File> File::open_at(const DirHandle& dir, const std::string& name,
                           const FileOptions& options) {
  if (!dir.is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "cannot open {}: its directory is not open",
                      name);
  }
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot open '{}' in {}: expected a plain file name", name, dir.path());
  }
  return open_relative(dir.fd(), name, dir.path() + "/" + name, options);
}

// ---- DirHandle ----------------------------------------------------------------------------------

Result<DirHandle> DirHandle::open(const std::string& path, bool no_follow) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | (no_follow ? O_NOFOLLOW : 0));
  if (fd < 0) return errno_status(errno, fmt::format("cannot open directory {}", path));
  return DirHandle(fd, path);
}

Result<DirHandle> DirHandle::open_at(const DirHandle& parent, const std::string& name) {
  std::string path = parent.path() + "/" + name;
  int fd = ::openat(parent.fd(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, fmt::format("cannot open directory {}", path));
  return DirHandle(fd, std::move(path));
}

DirHandle::DirHandle(DirHandle&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

DirHandle& DirHandle::operator=(DirHandle&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

DirHandle::~DirHandle() {
  if (fd_ >= 0) ::close(fd_);
}

// ---- File ---------------------------------------------------------------------------------------

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      direct_(other.direct_),
      mem_align_(other.mem_align_),
      offset_align_(other.offset_align_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    (void)close();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_ = other.direct_;
    mem_align_ = other.mem_align_;
    offset_align_ = other.offset_align_;
  }
  return *this;
}

File::~File() {
  Status s = close();
  if (!s.is_ok()) log::warn("{}", s.to_string());
}

Status File::preallocate(uint64_t offset, uint64_t length) {
  if (length == 0) return Status::ok();
  if (auto fault = FaultInjector::global().on_preallocate(path_)) {
    return errno_status(*fault, fmt::format("cannot preallocate {} bytes at offset {} of {}",
                                            length, offset, path_));
  }
  int rc = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  if (rc != 0 && errno == EOPNOTSUPP) {
    rc = ::posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(length));
    if (rc != 0) errno = rc;
  }
  if (rc != 0) {
    return errno_status(errno, fmt::format("cannot preallocate {} bytes at offset {} of {}", length,
                                           offset, path_));
  }
  return Status::ok();
}

Result<uint64_t> File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return errno_status(errno, fmt::format("cannot stat {}", path_));
  return static_cast<uint64_t>(st.st_size);
}

Status File::sync() {
  if (::fdatasync(fd_) != 0) return errno_status(errno, fmt::format("cannot sync {}", path_));
  return Status::ok();
}

Status File::close() {
  if (fd_ < 0) return Status::ok();
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) return errno_status(errno, fmt::format("error closing {}", path_));
  return Status::ok();
}

}  // namespace zinf::io
