#include "zinf/io/swap_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>

#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/io/checksum.h"

namespace zinf::io {
namespace {

struct SwapFile {
  File file;
  uint64_t size = 0;
  std::map<uint64_t, uint64_t> free;  // offset -> length, coalesced

  std::optional<uint64_t> take(uint64_t length) {
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->second < length) continue;
      uint64_t offset = it->first;
      uint64_t rest = it->second - length;
      free.erase(it);
      if (rest > 0) free.emplace(offset + length, rest);
      return offset;
    }
    return std::nullopt;
  }

  void give_back(uint64_t offset, uint64_t length) {
    auto next = free.lower_bound(offset);
    if (next != free.end() && offset + length == next->first) {
      length += next->second;
      next = free.erase(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += length;
        return;
      }
    }
    free.emplace(offset, length);
  }
};

struct Directory {
  DirHandle root;        // the directory the user named
  std::string run_name;  // the run directory's name inside it
  DirHandle run;         // the run directory: swap files are created and removed relative to it
  std::vector<std::unique_ptr<SwapFile>> files;
  uint32_t files_created = 0;
};

std::string file_name(uint32_t index) { return fmt::format("swap-{}.bin", index); }

// Removes the (empty) run directory; a warning names it when it cannot.
void remove_run_directory(Directory& d) {
  d.run = DirHandle();
  if (::unlinkat(d.root.fd(), d.run_name.c_str(), AT_REMOVEDIR) != 0) {
    log::warn("cannot remove run directory {}/{}: {}", d.root.path(), d.run_name,
              std::strerror(errno));
  }
}

struct Piece {
  SwapFile* file;
  uint64_t file_offset;
  uint64_t extent_offset;
  uint64_t length;
};

struct Extent {
  std::string name;
  uint64_t padded = 0;
  std::vector<Piece> pieces;
  std::vector<std::optional<uint64_t>> checksums;  // one per kChecksumBlock; unset: never written
  uint32_t in_flight = 0;
};

}  // namespace

struct SwapSpace::Impl {
  IoEngine& engine;
  SwapSpaceOptions options;

  mutable std::mutex mu;
  std::condition_variable idle_cv;
  std::vector<Directory> dirs;
  std::unordered_map<ExtentId, Extent> extents;
  ExtentId next_id = 1;
  uint32_t next_dir = 0;
  uint64_t in_flight = 0;
  SwapStats stats;

  Impl(IoEngine& e, SwapSpaceOptions o) : engine(e), options(std::move(o)) {}

  std::string describe(ExtentId id, const Extent& e) const {
    return e.name.empty() ? fmt::format("swap extent {}", id)
                          : fmt::format("swap extent {} ({})", id, e.name);
  }

  // Caller holds mu.
  Result<Piece> allocate_in(Directory& dir, uint64_t length) {
    for (auto& f : dir.files) {
      if (auto offset = f->take(length)) return Piece{f.get(), *offset, 0, length};
    }
    uint64_t file_size = std::max(options.file_bytes, length);
    const std::string name = file_name(dir.files_created);
    FileOptions fo{.create = true, .exclusive = true, .direct = options.direct};
    ZINF_ASSIGN_OR_RETURN(File file, File::open_at(dir.run, name, fo));
    const std::string path = file.path();
    auto remove = [&] {
      (void)file.close();
      ::unlinkat(dir.run.fd(), name.c_str(), 0);
    };
    Status s = file.preallocate(0, file_size);
    if (!s.is_ok()) {
      remove();
      return std::move(s).with_context(
          fmt::format("swap space on {} is full or unusable ({} needed for a new swap file)",
                      dir.root.path(), format_bytes(static_cast<double>(file_size))));
    }
    if (file.offset_alignment() > kAlignment) {
      remove();
      return make_error(ErrorCode::kInvalidArgument,
                        "{} needs {}-byte direct I/O alignment; swap space supports up to {}", path,
                        file.offset_alignment(), kAlignment);
    }
    Status reg = engine.register_file(file);
    if (!reg.is_ok()) log::warn("{} (using the plain descriptor)", reg.to_string());
    auto swap = std::make_unique<SwapFile>();
    swap->file = std::move(file);
    swap->size = file_size;
    swap->free.emplace(0, file_size);
    ++dir.files_created;
    stats.bytes_reserved += file_size;
    ++stats.files;
    dir.files.push_back(std::move(swap));
    auto offset = dir.files.back()->take(length);
    ZINF_CHECK(offset.has_value());
    return Piece{dir.files.back().get(), *offset, 0, length};
  }

  void release_pieces(const std::vector<Piece>& pieces) {
    for (const Piece& p : pieces) p.file->give_back(p.file_offset, p.length);
  }

  // `check` (reads with checksums on): the checksums go there, for the caller to verify,
  // instead of being checked on the I/O thread.
  Status transfer(ExtentId id, IoOp op, uint64_t offset, uint64_t length, void* buffer,
                  std::function<void(Status)> done, ReadCheck* check = nullptr);
};

struct ReadCheck::Data {
  std::string what;  // the extent, for errors
  uint64_t offset = 0, length = 0;
  const void* buffer = nullptr;
  std::vector<std::optional<uint64_t>> expected;  // one per block of the range
};

namespace {

// The first block of [buffer, buffer + length) whose hash differs from `expected`.
Status check_blocks(const void* buffer, uint64_t offset, uint64_t length,
                    const std::vector<std::optional<uint64_t>>& expected) {
  for (size_t b = 0; b < expected.size(); ++b) {
    const uint64_t pos = b * SwapSpace::kChecksumBlock;
    const uint64_t got = checksum64(static_cast<const char*>(buffer) + pos,
                                    std::min(SwapSpace::kChecksumBlock, length - pos));
    if (got != *expected[b]) {
      return make_error(ErrorCode::kCorrupt,
                        "checksum mismatch in the {}-byte block at offset {}: expected {:016x}, "
                        "read {:016x}",
                        SwapSpace::kChecksumBlock, offset + pos, *expected[b], got);
    }
  }
  return Status::ok();
}

}  // namespace

SwapSpace::SwapSpace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::string swap_host_tag() {
  static const std::string tag = [] {
    std::string boot;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re")) {
      char buf[64] = {};
      if (std::fgets(buf, sizeof buf, f) != nullptr) boot = buf;
      std::fclose(f);
    }
    char ns[64] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (boot.empty() || n <= 0) return std::string();
    const std::string key = boot + std::string(ns, static_cast<size_t>(n));
    return fmt::format("{:08x}", static_cast<uint32_t>(checksum64(key.data(), key.size())));
  }();
  return tag;
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::create(IoEngine& engine, SwapSpaceOptions options) {
  if (options.directories.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "swap space needs at least one directory");
  }
  if (options.file_bytes == 0 || options.file_bytes % kAlignment != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "swap file size must be a positive multiple of {} bytes, got {}", kAlignment,
                      options.file_bytes);
  }
  auto impl = std::make_unique<Impl>(engine, options);
  // On a failure the run directories made so far are removed: nothing is left behind.
  auto undo = [&] {
    for (auto& d : impl->dirs) remove_run_directory(d);
  };
  std::random_device rd;
  for (const std::string& root : options.directories) {
    struct stat st {};
    if (::stat(root.c_str(), &st) != 0) {
      Status s = errno_status(errno, fmt::format("swap directory {} is not usable", root));
      undo();
      return s;
    }
    if (!S_ISDIR(st.st_mode) || ::access(root.c_str(), W_OK | X_OK) != 0) {
      undo();
      return make_error(ErrorCode::kInvalidArgument, "swap directory {} is {}", root,
                        S_ISDIR(st.st_mode) ? "not writable" : "not a directory");
    }
    auto root_dir = DirHandle::open(root);
    if (!root_dir.is_ok()) {
      undo();
      return std::move(root_dir).take_status().with_context("swap directory");
    }
    // Private: 0700 whatever the umask (which can only take bits away), opened without following
    // a symlink, and checked to be the directory just made.
    const std::string host = swap_host_tag();
    std::string run_name =
        fmt::format("zinf-{}-{}-{:08x}", ::getpid(), host.empty() ? "unknown" : host, rd());
    std::string run_path = root + "/" + run_name;
    if (::mkdirat(root_dir->fd(), run_name.c_str(), 0700) != 0) {
      Status s = errno_status(errno, fmt::format("cannot create run directory {}", run_path));
      undo();
      return s;
    }
    Directory d{.root = std::move(*root_dir), .run_name = run_name};
    auto run = DirHandle::open_at(d.root, run_name);
    Status made = run.is_ok() ? Status::ok() : run.status();
    struct stat run_st {};
    if (made.is_ok() && ::fstat(run->fd(), &run_st) != 0) {
      made = errno_status(errno, fmt::format("cannot stat run directory {}", run_path));
    } else if (made.is_ok() && (run_st.st_uid != ::geteuid() || (run_st.st_mode & 0077) != 0)) {
      made = make_error(ErrorCode::kInvalidArgument,
                        "run directory {} is not private to this user (mode {:o}, owner {})",
                        run_path, run_st.st_mode & 07777, run_st.st_uid);
    } else if (made.is_ok() && ::fchmod(run->fd(), 0700) != 0) {
      made = errno_status(errno, fmt::format("cannot set the mode of run directory {}", run_path));
    }
    if (!made.is_ok()) {
      impl->dirs.push_back(std::move(d));
      undo();
      return made;
    }
    d.run = std::move(*run);
    impl->dirs.push_back(std::move(d));
  }
  return std::unique_ptr<SwapSpace>(new SwapSpace(std::move(impl)));
}

SwapSpace::~SwapSpace() {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  // Bounded as the I/O engine's own drain: past the deadline the transfers still in flight are
  // abandoned with the files (removed), and the state their callbacks touch is left allocated.
  const auto timeout = std::chrono::milliseconds(s.engine.options().drain_timeout_ms);
  if (!s.idle_cv.wait_for(lock, timeout, [&] { return s.in_flight == 0; })) {
    log::error("swap space: {} transfer(s) still in flight after {} ms at shutdown; abandoned",
               s.in_flight, timeout.count());
    (void)impl_.release();
  }
  for (auto& dir : s.dirs) {
    for (size_t i = 0; i < dir.files.size(); ++i) {
      File& file = dir.files[i]->file;
      (void)s.engine.unregister_file(file);
      std::string path = file.path();
      Status c = file.close();
      if (!c.is_ok()) log::warn("{}", c.to_string());
      const std::string name = path.substr(path.rfind('/') + 1);
      if (::unlinkat(dir.run.fd(), name.c_str(), 0) != 0) {
        log::warn("cannot remove swap file {}: {}", path, std::strerror(errno));
      }
    }
    remove_run_directory(dir);
  }
}

Result<ExtentId> SwapSpace::allocate(uint64_t bytes, std::string name) {
  if (bytes == 0) {
    return make_error(ErrorCode::kInvalidArgument, "cannot allocate an empty swap extent{}",
                      name.empty() ? "" : " for " + name);
  }
  Impl& s = *impl_;
  uint64_t padded = align_up(bytes, kAlignment);
  std::lock_guard lock(s.mu);
  const uint64_t ndirs = s.dirs.size();
  Extent extent{.name = std::move(name), .padded = padded};
  // Stripe over every directory when each piece is big enough; else one piece, round robin.
  uint64_t per_dir = align_up((padded + ndirs - 1) / ndirs, kAlignment);
  bool stripe = ndirs > 1 && per_dir >= s.options.stripe_min_bytes;
  uint64_t placed = 0;
  for (uint64_t i = 0; placed < padded; ++i) {
    Directory& dir = stripe ? s.dirs[i] : s.dirs[s.next_dir++ % ndirs];
    uint64_t length = stripe ? std::min(per_dir, padded - placed) : padded;
    auto piece = s.allocate_in(dir, length);
    if (!piece.is_ok()) {
      s.release_pieces(extent.pieces);
      return std::move(piece).take_status().with_context(
          extent.name.empty()
              ? fmt::format("allocating {} bytes of swap", padded)
              : fmt::format("allocating {} bytes of swap for {}", padded, extent.name));
    }
    piece->extent_offset = placed;
    placed += length;
    extent.pieces.push_back(*piece);
  }
  extent.checksums.resize((padded + kChecksumBlock - 1) / kChecksumBlock);
  ExtentId id = s.next_id++;
  s.extents.emplace(id, std::move(extent));
  ++s.stats.extents;
  s.stats.bytes_allocated += padded;
  return id;
}

Status SwapSpace::free(ExtentId id) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  auto it = s.extents.find(id);
  if (it == s.extents.end()) {
    return make_error(ErrorCode::kNotFound, "swap extent {} does not exist", id);
  }
  ZINF_CHECK(it->second.in_flight == 0, "{} freed with I/O in flight", s.describe(id, it->second));
  s.release_pieces(it->second.pieces);
  --s.stats.extents;
  s.stats.bytes_allocated -= it->second.padded;
  s.extents.erase(it);
  return Status::ok();
}

uint64_t SwapSpace::padded_bytes(ExtentId id) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->extents.find(id);
  return it == impl_->extents.end() ? 0 : it->second.padded;
}

Status SwapSpace::Impl::transfer(ExtentId id, IoOp op, uint64_t offset, uint64_t length,
                                 void* buffer, std::function<void(Status)> done, ReadCheck* check) {
  std::vector<IoRequest> requests;
  std::string what;
  std::vector<std::optional<uint64_t>> expected;  // checksums of the blocks in range (reads)
  const uint64_t first_block = offset / kChecksumBlock;
  {
    std::lock_guard lock(mu);
    auto it = extents.find(id);
    if (it == extents.end()) {
      return make_error(ErrorCode::kNotFound, "swap extent {} does not exist", id);
    }
    Extent& e = it->second;
    what = describe(id, e);
    if (length == 0 || offset % kAlignment != 0 || length % kAlignment != 0 ||
        offset + length > e.padded) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: range of {} bytes at offset {} is not 4 KiB aligned inside its {} "
                        "bytes",
                        what, length, offset, e.padded);
    }
    if (options.checksum && (offset % kChecksumBlock != 0 ||
                             (length % kChecksumBlock != 0 && offset + length != e.padded))) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: with checksums on, ranges must start and end on {}-byte blocks "
                        "(offset {}, length {})",
                        what, kChecksumBlock, offset, length);
    }
    if (op == IoOp::kRead && options.checksum) {
      for (uint64_t b = first_block; b * kChecksumBlock < offset + length; ++b) {
        if (!e.checksums[b]) {
          return make_error(ErrorCode::kInvalidArgument,
                            "{} is read at offset {} before it was ever written", what,
                            b * kChecksumBlock);
        }
        expected.push_back(e.checksums[b]);
      }
    }
    for (const Piece& p : e.pieces) {
      uint64_t lo = std::max(offset, p.extent_offset);
      uint64_t hi = std::min(offset + length, p.extent_offset + p.length);
      if (lo >= hi) continue;
      requests.push_back(IoRequest{.op = op,
                                   .file = &p.file->file,
                                   .offset = p.file_offset + (lo - p.extent_offset),
                                   .buffer = static_cast<char*>(buffer) + (lo - offset),
                                   .length = hi - lo});
    }
    ++e.in_flight;
    ++in_flight;
  }
  if (check != nullptr && !expected.empty()) {
    auto data = std::make_shared<ReadCheck::Data>();
    data->what = what;
    data->offset = offset;
    data->length = length;
    data->buffer = buffer;
    data->expected = std::move(expected);
    expected.clear();  // (nothing left to check on the I/O thread)
    check->data_ = std::move(data);
  }
  // Checksums of the written blocks, computed before the data leaves.
  std::vector<uint64_t> written;
  if (op == IoOp::kWrite && options.checksum) {
    for (uint64_t pos = 0; pos < length; pos += kChecksumBlock) {
      written.push_back(
          checksum64(static_cast<char*>(buffer) + pos, std::min(kChecksumBlock, length - pos)));
    }
  }

  // Joins the pieces: the last one to finish reports the range's outcome.
  struct Join {
    std::mutex mu;
    size_t remaining;
    Status first_error;
  };
  auto join = std::make_shared<Join>();
  join->remaining = requests.size();
  auto finish = [this, id, op, offset, length, buffer, first_block, what,
                 expected = std::move(expected), written = std::move(written),
                 done = std::move(done)](Status st) {
    if (st.is_ok() && op == IoOp::kRead) st = check_blocks(buffer, offset, length, expected);
    if (!st.is_ok()) st.with_context(what);
    {
      std::lock_guard lock(mu);
      if (auto it = extents.find(id); it != extents.end()) {
        --it->second.in_flight;
        for (size_t b = 0; op == IoOp::kWrite && b * kChecksumBlock < length; ++b) {
          // A failed write leaves the blocks unknown: they read as never written.
          it->second.checksums[first_block + b] =
              st.is_ok() && options.checksum ? std::optional<uint64_t>(written[b]) : std::nullopt;
        }
      }
      if (st.is_ok()) (op == IoOp::kRead ? stats.bytes_read : stats.bytes_written) += length;
    }
    done(std::move(st));
    std::lock_guard lock(mu);
    if (--in_flight == 0) idle_cv.notify_all();
  };
  auto shared_finish = std::make_shared<decltype(finish)>(std::move(finish));

  std::vector<IoCallback> callbacks;
  for (size_t i = 0; i < requests.size(); ++i) {
    callbacks.push_back([join, shared_finish](Status st) {
      bool last;
      Status outcome;
      {
        std::lock_guard lock(join->mu);
        if (!st.is_ok() && join->first_error.is_ok()) join->first_error = std::move(st);
        last = --join->remaining == 0;
        if (last) outcome = std::move(join->first_error);
      }
      if (last) (*shared_finish)(std::move(outcome));
    });
  }
  size_t accepted = 0;
  Status s = engine.submit_batch(requests, callbacks, &accepted);
  if (!s.is_ok()) {
    // Pieces refused before submission never call back: account for them here.
    size_t refused = requests.size() - accepted;
    bool last;
    Status outcome;
    {
      std::lock_guard lock(join->mu);
      if (join->first_error.is_ok()) join->first_error = s;
      join->remaining -= refused;
      last = join->remaining == 0;
      if (last) outcome = std::move(join->first_error);
    }
    if (last) (*shared_finish)(std::move(outcome));
  }
  return Status::ok();
}

Status SwapSpace::write_async(ExtentId id, const void* buffer, std::function<void(Status)> done) {
  return write_range_async(id, 0, padded_bytes(id), buffer, std::move(done));
}

Status SwapSpace::read_async(ExtentId id, void* buffer, std::function<void(Status)> done) {
  return read_range_async(id, 0, padded_bytes(id), buffer, std::move(done));
}

Status SwapSpace::write_range_async(ExtentId id, uint64_t offset, uint64_t length,
                                    const void* buffer, std::function<void(Status)> done) {
  if (padded_bytes(id) == 0) {
    return make_error(ErrorCode::kNotFound, "swap extent {} does not exist", id);
  }
  return impl_->transfer(id, IoOp::kWrite, offset, length, const_cast<void*>(buffer),
                         std::move(done));
}

Status SwapSpace::read_range_async(ExtentId id, uint64_t offset, uint64_t length, void* buffer,
                                   std::function<void(Status)> done) {
  if (padded_bytes(id) == 0) {
    return make_error(ErrorCode::kNotFound, "swap extent {} does not exist", id);
  }
  return impl_->transfer(id, IoOp::kRead, offset, length, buffer, std::move(done));
}

Status SwapSpace::read_range_async(ExtentId id, uint64_t offset, uint64_t length, void* buffer,
                                   std::function<void(Status)> done, ReadCheck& check) {
  check = ReadCheck();
  if (padded_bytes(id) == 0) {
    return make_error(ErrorCode::kNotFound, "swap extent {} does not exist", id);
  }
  return impl_->transfer(id, IoOp::kRead, offset, length, buffer, std::move(done), &check);
}

Status SwapSpace::verify(const ReadCheck& check) const {
  if (!check) return Status::ok();
  const ReadCheck::Data& d = *check.data_;
  Status st = check_blocks(d.buffer, d.offset, d.length, d.expected);
  if (!st.is_ok()) st.with_context(d.what);
  return st;
}

Status SwapSpace::write_range(ExtentId id, uint64_t offset, uint64_t length, const void* buffer) {
  std::promise<Status> p;
  auto f = p.get_future();
  ZINF_RETURN_IF_ERROR(
      write_range_async(id, offset, length, buffer, [&p](Status s) { p.set_value(std::move(s)); }));
  return f.get();
}

Status SwapSpace::read_range(ExtentId id, uint64_t offset, uint64_t length, void* buffer) {
  std::promise<Status> p;
  auto f = p.get_future();
  ReadCheck check;
  ZINF_RETURN_IF_ERROR(read_range_async(
      id, offset, length, buffer, [&p](Status s) { p.set_value(std::move(s)); }, check));
  ZINF_RETURN_IF_ERROR(f.get());
  return verify(check);  // on this thread, not the ring's
}

Status SwapSpace::write(ExtentId id, const void* buffer) {
  std::promise<Status> p;
  auto f = p.get_future();
  ZINF_RETURN_IF_ERROR(write_async(id, buffer, [&p](Status s) { p.set_value(std::move(s)); }));
  return f.get();
}

Status SwapSpace::read(ExtentId id, void* buffer) {
  return read_range(id, 0, padded_bytes(id), buffer);
}

SwapStats SwapSpace::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

std::vector<std::string> SwapSpace::run_directories() const {
  std::lock_guard lock(impl_->mu);
  std::vector<std::string> out;
  for (auto& d : impl_->dirs) out.push_back(d.root.path() + "/" + d.run_name);
  return out;
}

}  // namespace zinf::io
