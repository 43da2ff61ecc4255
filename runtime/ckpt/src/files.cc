#include "zinf/ckpt/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <utility>
#include <vector>

namespace zinf::ckpt {
namespace {

XXH3_state_t* state(void* p) { return static_cast<XXH3_state_t*>(p); }

constexpr uint64_t kDirectAlign = 4096;

}  // namespace

uint64_t xxh3(const void* data, uint64_t bytes) { return XXH3_64bits(data, bytes); }

// ---- ShardWriter --------------------------------------------------------------------------------

Result<ShardWriter> ShardWriter::create(const std::string& dir, const std::string& name) {
  ShardWriter w;
  w.name_ = name;
  w.path_ = dir + "/" + name;
  // O_DIRECT first: on the disks measured, buffered writes and an fsync ran at a tenth of what
  // direct writes reach (docs/checkpoints.md). A file system that refuses it gets buffered I/O.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  w.fd_ = ::open(w.path_.c_str(), flags | O_DIRECT, 0600);
  w.direct_ = w.fd_ >= 0;
  if (w.fd_ < 0 && errno == EINVAL) w.fd_ = ::open(w.path_.c_str(), flags, 0600);
  if (w.fd_ < 0) return errno_status(errno, "cannot create checkpoint file " + w.path_);
  w.hash_ = XXH3_createState();
  if (w.hash_ == nullptr) {
    return make_error(ErrorCode::kOutOfMemory, "no memory for the checksum of {}", w.path_);
  }
  XXH3_64bits_reset(state(w.hash_));
  return w;
}

ShardWriter::ShardWriter(ShardWriter&& o) noexcept { *this = std::move(o); }

ShardWriter& ShardWriter::operator=(ShardWriter&& o) noexcept {
  if (this != &o) {
    close_fd();
    if (hash_) XXH3_freeState(state(hash_));
    fd_ = std::exchange(o.fd_, -1);
    name_ = std::move(o.name_);
    path_ = std::move(o.path_);
    offset_ = o.offset_;
    direct_ = o.direct_;
    hash_ = std::exchange(o.hash_, nullptr);
  }
  return *this;
}

ShardWriter::~ShardWriter() {
  close_fd();
  if (hash_) XXH3_freeState(state(hash_));
}

void ShardWriter::close_fd() {
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = -1;
}

Status ShardWriter::write(const void* data, uint64_t bytes) {
  if (fd_ < 0) return make_error(ErrorCode::kInvalidArgument, "{} is not open", path_);
  XXH3_64bits_update(state(hash_), data, bytes);
  // Direct I/O needs whole aligned blocks: the first write that is not turns it off for good
  // (the engine's tensors are 4 KiB-aligned whole blocks; small files are not).
  if (direct_ && (reinterpret_cast<uintptr_t>(data) % kDirectAlign != 0 ||
                  bytes % kDirectAlign != 0 || offset_ % kDirectAlign != 0)) {
    const int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl & ~O_DIRECT) != 0) {
      return errno_status(errno, "turning off direct I/O on " + path_);
    }
    direct_ = false;
  }
  const char* p = static_cast<const char*>(data);
  uint64_t left = bytes;
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return errno_status(n < 0 ? errno : EIO, fmt::format("writing {} bytes to {} at offset {}",
                                                           left, path_, offset_ + (bytes - left)));
    }
    p += n;
    left -= static_cast<uint64_t>(n);
  }
  offset_ += bytes;
  return Status::ok();
}

Result<FileDigest> ShardWriter::finish() {
  if (fd_ < 0) return make_error(ErrorCode::kInvalidArgument, "{} is not open", path_);
  if (::fsync(fd_) != 0) {
    const int err = errno;
    close_fd();
    return errno_status(err, "fsync of " + path_);
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) return errno_status(errno, "closing " + path_);
  return FileDigest{.name = name_, .bytes = offset_, .xxh3 = XXH3_64bits_digest(state(hash_))};
}

// ---- ShardReader --------------------------------------------------------------------------------

Result<ShardReader> ShardReader::open(const std::string& dir, const FileDigest& expected) {
  ShardReader r;
  r.path_ = dir + "/" + expected.name;
  r.fd_ = ::open(r.path_.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (r.fd_ < 0) return errno_status(errno, "cannot open checkpoint file " + r.path_);
  struct stat st {};
  if (::fstat(r.fd_, &st) != 0) return errno_status(errno, "stat of " + r.path_);
  r.bytes_ = static_cast<uint64_t>(st.st_size);
  if (r.bytes_ != expected.bytes) {
    return make_error(ErrorCode::kCorrupt,
                      "checkpoint file {} holds {} bytes, the manifest says {}{}", r.path_,
                      r.bytes_, expected.bytes, r.bytes_ < expected.bytes ? " (truncated)" : "");
  }
  return r;
}

ShardReader::ShardReader(ShardReader&& o) noexcept { *this = std::move(o); }

ShardReader& ShardReader::operator=(ShardReader&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) (void)::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    bytes_ = o.bytes_;
  }
  return *this;
}

ShardReader::~ShardReader() {
  if (fd_ >= 0) (void)::close(fd_);
}

Status ShardReader::read_at(uint64_t offset, void* data, uint64_t bytes) const {
  if (offset + bytes > bytes_) {
    return make_error(ErrorCode::kCorrupt, "{}: {} bytes at offset {} lie past its end ({} bytes)",
                      path_, bytes, offset, bytes_);
  }
  char* p = static_cast<char*>(data);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return errno_status(n < 0 ? errno : EIO, fmt::format("reading {} bytes of {} at offset {}",
                                                           bytes - done, path_, offset + done));
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

// ---- whole files --------------------------------------------------------------------------------

Status verify_file(const std::string& dir, const FileDigest& expected, uint64_t buffer_bytes) {
  ZINF_ASSIGN_OR_RETURN(ShardReader r, ShardReader::open(dir, expected));
  XXH3_state_t* h = XXH3_createState();
  if (h == nullptr) return make_error(ErrorCode::kOutOfMemory, "no memory to verify {}", r.path());
  XXH3_64bits_reset(h);
  std::vector<char> buffer(std::max<uint64_t>(4096, buffer_bytes));
  Status st;
  for (uint64_t off = 0; off < expected.bytes && st.is_ok();) {
    const uint64_t n = std::min<uint64_t>(buffer.size(), expected.bytes - off);
    st = r.read_at(off, buffer.data(), n);
    if (st.is_ok()) XXH3_64bits_update(h, buffer.data(), n);
    off += n;
  }
  const uint64_t got = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  ZINF_RETURN_IF_ERROR(st);
  if (got != expected.xxh3) {
    return make_error(
        ErrorCode::kCorrupt,
        "checkpoint file {} is corrupt: its XXH3 is {:016x}, the manifest says {:016x}", r.path(),
        got, expected.xxh3);
  }
  return Status::ok();
}

Result<FileDigest> write_small_file(const std::string& dir, const std::string& name,
                                    const std::string& text) {
  ZINF_ASSIGN_OR_RETURN(ShardWriter w, ShardWriter::create(dir, name));
  ZINF_RETURN_IF_ERROR(w.write(text.data(), text.size()));
  return w.finish();
}

Result<std::string> read_small_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "cannot open " + path);
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      (void)::close(fd);
      return errno_status(err, "reading " + path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  (void)::close(fd);
  return out;
}

}  // namespace zinf::ckpt
