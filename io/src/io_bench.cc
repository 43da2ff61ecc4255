#include "zinf/io/io_bench.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "zinf/core/units.h"
#include "zinf/io/aligned_buffer.h"
#include "zinf/io/io_engine.h"

namespace zinf::io {
namespace {

constexpr uint64_t kSector = 4096;
constexpr uint64_t kStampMagic = 0x7a696e66'00000000ull;  // "zinf"

uint64_t stamp_for(uint64_t offset, uint64_t seed) {
  return kStampMagic ^ (offset * 0x9e3779b97f4a7c15ull) ^ seed;
}

void stamp_block(std::byte* buf, uint64_t block_bytes, uint64_t offset, uint64_t seed) {
  for (uint64_t s = 0; s < block_bytes; s += kSector) {
    uint64_t v = stamp_for(offset + s, seed);
    std::memcpy(buf + s, &v, sizeof(v));
  }
}

// Number of sectors whose stamp is wrong.
uint64_t check_block(const std::byte* buf, uint64_t block_bytes, uint64_t offset, uint64_t seed) {
  uint64_t bad = 0;
  for (uint64_t s = 0; s < block_bytes; s += kSector) {
    uint64_t v;
    std::memcpy(&v, buf + s, sizeof(v));
    bad += v != stamp_for(offset + s, seed);
  }
  return bad;
}

// One pass over the files with `queue_depth` blocks in flight per thread region; block i lives in
// file i mod n at offset (i / n) * block_size.
class Pass {
 public:
  Pass(IoEngine& engine, const std::vector<File>& files, const IoBenchOptions& o, bool write,
       bool random, const std::vector<std::byte*>& slots)
      : engine_(engine), files_(files), o_(o), write_(write), slots_(slots) {
    const uint64_t blocks = o.size / o.block_size;
    const uint64_t per_thread = blocks / o.threads;
    std::mt19937_64 rng(o.seed);
    for (uint32_t t = 0; t < o.threads; ++t) {
      Region r;
      uint64_t first = t * per_thread;
      uint64_t count = t + 1 == o.threads ? blocks - first : per_thread;
      r.order.resize(count);
      std::iota(r.order.begin(), r.order.end(), first);
      if (random) std::shuffle(r.order.begin(), r.order.end(), rng);
      regions_.push_back(std::move(r));
    }
    total_bytes_ = blocks * o.block_size;
  }

  Status run(const char* phase, const IoBenchProgress& progress, double* seconds) {
    auto start = std::chrono::steady_clock::now();
    for (uint32_t t = 0; t < o_.threads; ++t) {
      for (uint32_t q = 0; q < o_.queue_depth; ++q) {
        active_.fetch_add(1);
        next(t, t * o_.queue_depth + q);
      }
    }
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return active_ == 0; })) {
      if (progress) {
        double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        progress(phase, done_bytes_.load(), total_bytes_, el);
      }
    }
    *seconds = std::chrono::duration<double>(end_ - start).count();
    if (progress) progress(phase, done_bytes_.load(), total_bytes_, *seconds);
    if (!error_.is_ok()) return error_;
    if (bad_sectors_ > 0) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: {} sectors read back did not hold what was written",
                        files_.front().path(), bad_sectors_.load());
    }
    return Status::ok();
  }

  uint64_t verified_sectors() const { return verified_.load(); }

 private:
  struct Region {
    std::vector<uint64_t> order;
    std::atomic<uint64_t> next{0};
    Region() = default;
    Region(Region&& o) noexcept : order(std::move(o.order)), next(o.next.load()) {}
  };

  // Issues the next block of region t into slot s, or retires the slot.
  void next(uint32_t t, uint32_t s) {
    Region& r = regions_[t];
    uint64_t i = failed_.load() ? r.order.size() : r.next.fetch_add(1);
    if (i >= r.order.size()) {
      retire();
      return;
    }
    const uint64_t n = files_.size();
    const File& file = files_[r.order[i] % n];
    const uint64_t offset = r.order[i] / n * o_.block_size;
    const uint64_t seed = o_.seed + r.order[i] % n;  // a stamp names the file too
    std::byte* buf = slots_[s];
    if (write_) stamp_block(buf, o_.block_size, offset, seed);
    Status st = engine_.submit(IoRequest{.op = write_ ? IoOp::kWrite : IoOp::kRead,
                                         .file = &file,
                                         .offset = offset,
                                         .buffer = buf,
                                         .length = o_.block_size},
                               [this, t, s, offset, seed, buf](Status result) {
                                 if (!result.is_ok()) {
                                   fail(std::move(result));
                                 } else {
                                   if (!write_) {
                                     bad_sectors_ += check_block(buf, o_.block_size, offset, seed);
                                     verified_ += o_.block_size / kSector;
                                   }
                                   done_bytes_ += o_.block_size;
                                 }
                                 next(t, s);
                               });
    if (!st.is_ok()) {
      fail(std::move(st));
      retire();
    }
  }

  void fail(Status s) {
    std::lock_guard lock(mu_);
    if (error_.is_ok()) error_ = std::move(s);
    failed_ = true;
  }

  void retire() {
    std::lock_guard lock(mu_);
    if (--active_ == 0) {
      end_ = std::chrono::steady_clock::now();
      cv_.notify_all();
    }
  }

  IoEngine& engine_;
  const std::vector<File>& files_;
  const IoBenchOptions& o_;
  bool write_;
  const std::vector<std::byte*>& slots_;
  std::vector<Region> regions_;
  uint64_t total_bytes_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint32_t> active_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> done_bytes_{0}, verified_{0}, bad_sectors_{0};
  Status error_;
  std::chrono::steady_clock::time_point end_;
};

}  // namespace

const char* pattern_name(BenchPattern p) {
  switch (p) {
    case BenchPattern::kRead:
      return "read";
    case BenchPattern::kWrite:
      return "write";
    case BenchPattern::kRandRead:
      return "randread";
    case BenchPattern::kRandWrite:
      return "randwrite";
  }
  return "?";
}

Result<BenchPattern> parse_pattern(const std::string& s) {
  for (auto p : {BenchPattern::kRead, BenchPattern::kWrite, BenchPattern::kRandRead,
                 BenchPattern::kRandWrite}) {
    if (s == pattern_name(p)) return p;
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "--rw must be read, write, randread or randwrite, got '{}'", s);
}

Status validate_io_bench(const IoBenchOptions& o) {
  if (o.block_size == 0) return make_error(ErrorCode::kInvalidArgument, "block size must not be 0");
  if (o.block_size % kSector != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "block size {} is not a multiple of the {}-byte direct I/O alignment",
                      o.block_size, kSector);
  }
  if (o.block_size > (1ull << 30)) {
    return make_error(ErrorCode::kInvalidArgument, "block size {} is larger than 1 GiB",
                      o.block_size);
  }
  if (o.size == 0) return make_error(ErrorCode::kInvalidArgument, "size must not be 0");
  if (o.size % o.block_size != 0) {
    return make_error(ErrorCode::kInvalidArgument, "size {} is not a multiple of the block size {}",
                      o.size, o.block_size);
  }
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return make_error(ErrorCode::kInvalidArgument, "queue depth must be 1..4096, got {}",
                      o.queue_depth);
  }
  if (o.threads == 0 || o.threads > 64) {
    return make_error(ErrorCode::kInvalidArgument, "threads must be 1..64, got {}", o.threads);
  }
  if (o.size / o.block_size < o.threads) {
    return make_error(ErrorCode::kInvalidArgument, "size {} holds fewer blocks than threads ({})",
                      o.size, o.threads);
  }
  if (o.block_size * o.queue_depth * o.threads > (8ull << 30)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "block size x queue depth x threads needs more than 8 GiB of buffers");
  }
  if (o.directories.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "no directory to benchmark");
  }
  const uint64_t per_file =
      align_up(o.size / o.block_size, o.directories.size()) / o.directories.size() * o.block_size;
  for (const std::string& dir : o.directories) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return errno_status(errno, fmt::format("path {} is not usable", dir));
    }
    if (!S_ISDIR(st.st_mode)) {
      return make_error(ErrorCode::kInvalidArgument, "path {} is not a directory", dir);
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      return errno_status(errno, fmt::format("path {} is not writable", dir));
    }
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) == 0) {
      const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      // Directories on one file system share its free space.
      uint64_t needed = 0;
      for (const std::string& other : o.directories) {
        struct stat ost {};
        if (::stat(other.c_str(), &ost) == 0 && ost.st_dev == st.st_dev) needed += per_file;
      }
      if (avail < needed) {
        return make_error(ErrorCode::kNoSpace, "path {} has {} free, the benchmark needs {}", dir,
                          format_bytes(static_cast<double>(avail)),
                          format_bytes(static_cast<double>(needed)));
      }
    }
  }
  return Status::ok();
}

Result<IoBenchResult> run_io_bench(const IoBenchOptions& o, const IoBenchProgress& progress) {
  ZINF_RETURN_IF_ERROR(validate_io_bench(o));
  IoBenchResult result;
  const uint64_t n = o.directories.size();
  const uint64_t per_file = align_up(o.size / o.block_size, n) / n * o.block_size;
  // Removes the files on every path out of here.
  struct Remove {
    std::vector<std::string> paths;
    ~Remove() {
      for (const std::string& p : paths) ::unlink(p.c_str());
    }
  } remove;
  std::vector<File> files;
  result.direct = true;
  for (uint64_t i = 0; i < n; ++i) {
    const std::string path =
        n == 1 ? fmt::format("{}/zinf-bench-{}.dat", o.directories[i], ::getpid())
               : fmt::format("{}/zinf-bench-{}-{}.dat", o.directories[i], ::getpid(), i);
    ZINF_ASSIGN_OR_RETURN(File file, File::open(path, {.create = true, .exclusive = true}));
    remove.paths.push_back(path);
    result.files.push_back(path);
    result.direct = result.direct && file.direct();
    if (o.block_size % file.offset_alignment() != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "block size {} is not a multiple of the {}-byte alignment of {}",
                        o.block_size, file.offset_alignment(), path);
    }
    ZINF_RETURN_IF_ERROR(file.preallocate(0, per_file));
    files.push_back(std::move(file));
  }

  ZINF_ASSIGN_OR_RETURN(auto engine, IoEngine::create({.queue_depth = o.queue_depth,
                                                       .block_size = o.block_size,
                                                       .rings = o.threads,
                                                       .fixed_buffers = o.fixed_buffers,
                                                       .defer_taskrun = o.defer_taskrun}));
  for (const File& file : files) ZINF_RETURN_IF_ERROR(engine->register_file(file));
  // One slab for every slot, on huge pages where the system gives them (AlignedBuffer): a
  // 1 MiB slot in 4 KiB pages is 256 scattered pages, more than the 254 segments a virtio disk
  // takes in one request, so the block layer splits every request in two and cannot merge
  // neighbours; fio's buffers happened to be contiguous and its requests were not split.
  const uint64_t nslots = uint64_t{o.threads} * o.queue_depth;
  AlignedBuffer slab(nslots * o.block_size, AlignedBuffer::kHugePage);
  if (!slab) {
    return make_error(ErrorCode::kOutOfMemory, "cannot allocate {} I/O buffers of {} bytes", nslots,
                      o.block_size);
  }
  std::memset(slab.data(), 0xa5, slab.size());
  std::vector<std::byte*> slots;
  std::vector<int> registered;
  for (uint64_t i = 0; i < nslots; ++i) slots.push_back(slab.data() + i * o.block_size);
  if (o.fixed_buffers) {  // the slab as one fixed buffer, or slot by slot past 1 GiB
    auto whole = engine->register_buffer(slab.data(), slab.size());
    if (whole.is_ok()) {
      registered.push_back(*whole);
    } else {
      for (std::byte* slot_data : slots) {
        auto slot = engine->register_buffer(slot_data, o.block_size);
        if (slot.is_ok()) registered.push_back(*slot);
      }
    }
  }

  bool write = o.pattern == BenchPattern::kWrite || o.pattern == BenchPattern::kRandWrite;
  bool random = o.pattern == BenchPattern::kRandRead || o.pattern == BenchPattern::kRandWrite;
  double seconds = 0;
  if (!write) {  // lay the file out first (untimed), as fio does
    Pass layout(*engine, files, o, /*write=*/true, /*random=*/false, slots);
    ZINF_RETURN_IF_ERROR(layout.run("layout", progress, &seconds));
    // And make it durable before timing the reads, as fio does (create_fsync): a write the
    // device acknowledged may still be on its way to the medium, and reads would share the device
    // with it.
    for (File& file : files) ZINF_RETURN_IF_ERROR(file.sync());
  }
  Pass timed(*engine, files, o, write, random, slots);
  ZINF_RETURN_IF_ERROR(timed.run(pattern_name(o.pattern), progress, &seconds));
  result.seconds = seconds;
  result.deferred = engine->stats().deferred_rings == o.threads;
  result.verified_sectors = timed.verified_sectors();
  if (write) {  // read back what was written (untimed)
    double verify_seconds = 0;
    Pass verify(*engine, files, o, /*write=*/false, /*random=*/false, slots);
    ZINF_RETURN_IF_ERROR(verify.run("verify", progress, &verify_seconds));
    result.verified_sectors = verify.verified_sectors();
    if (o.time_read_back && verify_seconds > 0) {
      result.read_back_bytes_per_s = static_cast<double>(o.size) / verify_seconds;
    }
  }
  ZINF_RETURN_IF_ERROR(engine->drain());
  for (int slot : registered) (void)engine->unregister_buffer(slot);
  for (const File& file : files) (void)engine->unregister_file(file);
  result.bytes = o.size;
  result.bytes_per_s = seconds > 0 ? static_cast<double>(o.size) / seconds : 0;
  result.iops = seconds > 0 ? static_cast<double>(o.size / o.block_size) / seconds : 0;
  return result;
}

}  // namespace zinf::io
