#include "zinf/io/file.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

Result<File> File::open(const std::string& path, const FileOptions& options) {
  int flags = O_CLOEXEC | (options.read_only ? O_RDONLY : O_RDWR);
  if (options.create) flags |= O_CREAT;
  if (options.create && options.exclusive) flags |= O_EXCL;
  if (options.no_follow) flags |= O_NOFOLLOW;

  bool direct = options.direct;
  int fd = -1;
  if (direct) {
    if (FaultInjector::global().refuse_direct()) {
      errno = EINVAL;
    } else {
      fd = ::open(path.c_str(), flags | O_DIRECT, options.mode);
    }
    if (fd < 0 && errno == EINVAL) {
      // The file system refuses O_DIRECT (tmpfs on older kernels, some FUSE/network mounts).
      log::warn_once("odirect:" + path,
                     fmt::format("O_DIRECT refused for {}: falling back to buffered I/O "
                                 "(throughput will include the page cache)",
                                 path));
      direct = false;
    } else if (fd < 0) {
      return errno_status(errno, fmt::format("cannot open {}", path));
    }
  }
  if (!direct) {
    fd = ::open(path.c_str(), flags, options.mode);
    if (fd < 0) return errno_status(errno, fmt::format("cannot open {}", path));
  }
  auto [mem_align, offset_align] = direct ? dio_alignment(fd) : std::pair<uint32_t, uint32_t>{1, 1};
  return File(fd, path, direct, mem_align, offset_align);
}

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
