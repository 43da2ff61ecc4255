#include <sys/mman.h>

#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "block_cache.h"
#include "event_state.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/memory/device.h"

namespace zinf {

void Device::CommWindow::reset() {
  if (Status s = close(); !s.is_ok()) {
    log::warn_once("device:window", "a comm window closed unchecked failed: " + s.to_string());
  }
}

Event::Event() : state_(std::make_shared<State>()) { state_->done = true; }

bool Event::ready() const {
  std::lock_guard lock(state_->mu);
  return state_->done;
}

Status Event::wait() const {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) device_->release(data_, bytes_, category_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

namespace {

// A stream is a thread running its work in order.
class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::string name) : name_(std::move(name)) {
    thread_ = std::thread([this] { run(); });
  }
  ~CpuStream() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  const std::string& name() const override { return name_; }

  void enqueue(std::function<Status()> work) override {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_one();
  }

  Event record() override {
    auto state = std::make_shared<Event::State>();
    enqueue([this, state]() -> Status {
      state->complete(sticky_);
      return Status::ok();
    });
    return Event(state);
  }

  void wait_for(const Event& event) override {
    enqueue([event] { return event.wait(); });
  }

  Status synchronize() override {
    Status s = record().wait();
    enqueue([this] {
      sticky_ = Status::ok();
      return Status::ok();
    });
    (void)record().wait();
    return s;
  }

 private:
  void run() {
    while (true) {
      std::function<Status()> work;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything enqueued has run
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      Status s = work();
      if (!s.is_ok() && sticky_.is_ok()) sticky_ = std::move(s).with_context("stream " + name_);
    }
  }

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<Status()>> queue_;
  bool stopping_ = false;
  Status sticky_;  // touched only by the stream thread
  std::thread thread_;
};

// The device's allocations, for the strict variant: which are open to host code right now.
// An operation opens the allocations its operands lie in for its duration (counted, so that
// operations on several streams and comm windows may share one); the last to close maps the
// allocation PROT_NONE again.
class Regions {
 public:
  void add(void* base, uint64_t bytes) {
    std::lock_guard lock(mu_);
    regions_[reinterpret_cast<uintptr_t>(base)] = Region{.bytes = bytes};
  }
  void remove(void* base) {
    std::lock_guard lock(mu_);
    regions_.erase(reinterpret_cast<uintptr_t>(base));
  }
  // Opens the allocations holding each of `ranges` (pointers outside the device are host
  // memory and left alone), adding their bases to `opened` for close(). A failed mprotect is an
  // error naming the allocation (what was opened stays in `opened`).
  Status open(std::initializer_list<std::pair<const void*, uint64_t>> ranges,
              std::vector<uintptr_t>& opened) {
    std::lock_guard lock(mu_);
    for (auto [p, bytes] : ranges) {
      if (p == nullptr || bytes == 0) continue;
      auto it = find(reinterpret_cast<uintptr_t>(p));
      if (it == regions_.end()) continue;
      // An operand that runs past its allocation would touch a neighbour: a broken invariant.
      ZINF_CHECK(reinterpret_cast<uintptr_t>(p) + bytes <= it->first + it->second.bytes,
                 "an operand of {} bytes at {} runs past its device allocation ({} bytes at {:#x})",
                 bytes, p, it->second.bytes, it->first);
      if (it->second.opens == 0 && !protect(it->first, it->second.bytes, PROT_READ | PROT_WRITE)) {
        return make_error(ErrorCode::kInternal,
                          "strict device: mprotect(PROT_READ|PROT_WRITE) of {} bytes at {:#x}: {}",
                          it->second.bytes, it->first, std::strerror(errno));
      }
      ++it->second.opens;
      opened.push_back(it->first);
    }
    return Status::ok();
  }
  void close(const std::vector<uintptr_t>& opened) {
    std::lock_guard lock(mu_);
    for (uintptr_t base : opened) {
      auto it = regions_.find(base);
      if (it == regions_.end()) continue;  // freed while open: nothing left to protect
      // A failure to close again leaves the memory reachable: strictness is lost, not data.
      if (--it->second.opens == 0 && !protect(it->first, it->second.bytes, PROT_NONE)) {
        log::warn_once("cpu-strict:mprotect",
                       fmt::format("strict device: mprotect(PROT_NONE) failed ({}): device "
                                   "memory stays reachable to host code",
                                   std::strerror(errno)));
      }
    }
  }

 private:
  struct Region {
    uint64_t bytes = 0;
    int opens = 0;
  };
  std::map<uintptr_t, Region>::iterator find(uintptr_t p) {
    auto it = regions_.upper_bound(p);
    if (it == regions_.begin()) return regions_.end();
    --it;
    return p < it->first + it->second.bytes ? it : regions_.end();
  }
  static bool protect(uintptr_t base, uint64_t bytes, int prot) {
    return ::mprotect(reinterpret_cast<void*>(base), bytes, prot) == 0;
  }
  std::mutex mu_;
  std::map<uintptr_t, Region> regions_;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& o) : options_(o), blocks_(o.budget_bytes) {}
  ~CpuDevice() override {
    for (const BlockCache::Block& b : blocks_.drain()) unmap(b.data, b.bytes);
  }

  std::string name() const override { return options_.strict ? "cpu-strict" : "cpu"; }

  Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) override {
    if (bytes == 0) return DeviceBuffer();
    uint64_t padded = align_up(bytes, 4096);
    // Freed blocks stay mapped and are reused (block_cache.h): fresh pages would cost a page
    // fault each on first touch.
    ZINF_ASSIGN_OR_RETURN(BlockCache::Reservation r, blocks_.reserve(padded, bytes, category));
    for (const BlockCache::Block& b : r.evicted) unmap(b.data, b.bytes);
    void* p = r.reused != nullptr ? r.reused : map(padded);
    if (p == nullptr) {
      blocks_.unreserve(padded);
      return make_error(ErrorCode::kOutOfMemory, "host allocator refused {} for device memory",
                        format_bytes(static_cast<double>(padded)));
    }
    if (options_.ledger) options_.ledger->add(Tier::kDevice, category, padded);
    return DeviceBuffer(this, p, padded, category);
  }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CpuStream>(std::move(name));
  }

  void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) override {
    run(stream, {{dst, bytes}, {src, bytes}}, [=] { std::memcpy(dst, src, bytes); });
  }

  void fill(TensorRef dst, float value, Stream& stream) override {
    run(stream, {{dst.data, dst.bytes()}}, [=] {
      if (value == 0.0f && !std::signbit(value)) {
        std::memset(dst.data, 0, dst.bytes());
        return;
      }
      const float one[1] = {value};
      alignas(4) uint16_t half[1];
      const void* element = one;
      if (dst.dtype != DType::kF32) {
        kernels::cast(one, DType::kF32, half, dst.dtype, 1, 1);
        element = half;
      }
      const size_t size = dtype_size(dst.dtype);
      auto* out = static_cast<char*>(dst.data);
      for (uint64_t i = 0; i < dst.numel; ++i) std::memcpy(out + i * size, element, size);
    });
  }

  void accumulate(TensorRef acc, ConstTensorRef src, bool overwrite, Stream& stream) override {
    ZINF_CHECK(acc.dtype == DType::kF32 && acc.numel == src.numel,
               "accumulate: an fp32 accumulator of the source's length (got {} x {}, {} x {})",
               dtype_name(acc.dtype), acc.numel, dtype_name(src.dtype), src.numel);
    const int threads = options_.threads;
    run(stream, {{acc.data, acc.bytes()}, {src.data, src.bytes()}}, [=] {
      kernels::accumulate(static_cast<float*>(acc.data), src.data, src.dtype, src.numel, overwrite,
                          threads);
    });
  }

  void cast(TensorRef dst, ConstTensorRef src, Stream& stream) override {
    ZINF_CHECK(dst.numel == src.numel, "cast: {} elements into {}", src.numel, dst.numel);
    const int threads = options_.threads;
    run(stream, {{dst.data, dst.bytes()}, {src.data, src.bytes()}},
        [=] { kernels::cast(src.data, src.dtype, dst.data, dst.dtype, src.numel, threads); });
  }

  void scale(TensorRef x, float factor, bool* found_nonfinite, Stream& stream) override {
    const int threads = options_.threads;
    run(stream, {{x.data, x.bytes()}}, [=] {
      kernels::scale_inplace(x.data, x.dtype, x.numel, factor, threads);
      if (found_nonfinite) {
        *found_nonfinite = kernels::grad_has_nonfinite(x.data, x.dtype, x.numel, threads);
      }
    });
  }

  void sum_squares_blocks(ConstTensorRef x, float factor, double* block_sums,
                          Stream& stream) override {
    const int threads = options_.threads;
    run(stream, {{x.data, x.bytes()}}, [=] {
      kernels::grad_sum_squares_blocks(x.data, x.dtype, x.numel, factor, block_sums, threads);
    });
  }

  void adam(const kernels::AdamConfig& config, const kernels::AdamStepArgs& args,
            const kernels::AdamTensors& t, Stream& stream) override {
    const int threads = options_.threads;
    const uint64_t f32 = t.n * 4;
    run(stream,
        {{t.param, f32},
         {t.m, f32},
         {t.v, f32},
         {t.grad, t.n * dtype_size(t.grad_dtype)},
         {t.param_copy, t.param_copy ? t.n * dtype_size(t.copy_dtype) : 0}},
        [=] { (void)kernels::adam_step(config, args, t, threads); });
  }

  // The plain device's memory is host memory: the window is the range itself. The strict
  // device hands the communicator a host copy, as CUDA does, while its own memory stays
  // unreachable: a caller that used the device address, or declared the wrong access, fails
  // there (what it reads is copied in; a write-only window starts as NaN bytes, so a
  // collective that reads it shows; what it writes is copied back on close()).
  CommWindow comm_window(void* data, uint64_t bytes, WindowAccess access) override {
    if (!options_.strict || data == nullptr || bytes == 0) return CommWindow(data);
    std::shared_ptr<char[]> copy(new char[bytes]);
    Status in;
    if (access == WindowAccess::kWrite) {
      std::memset(copy.get(), 0xff, bytes);
    } else if (in = copy_range(copy.get(), data, bytes); !in.is_ok()) {
      std::memset(copy.get(), 0xff, bytes);  // the collective reads NaN bytes; close() says why
    }
    return CommWindow(copy.get(), [this, copy, data, bytes, access, in]() -> Status {
      if (!in.is_ok()) return Status(in).with_context("strict device: filling a comm window");
      if (access == WindowAccess::kRead) return Status::ok();
      return copy_range(data, copy.get(), bytes)
          .with_context("strict device: writing a comm window back");
    });
  }

  // The CPU device's memory is host memory: a host model computes on it in place (the strict
  // variant opens the range while the window lives).
  std::optional<CommWindow> host_window(void* data, uint64_t bytes) override {
    if (!options_.strict) return CommWindow(data);
    std::vector<uintptr_t> opened;
    if (Status s = regions_.open({{data, bytes}}, opened); !s.is_ok()) {
      // The model will fault on the memory it cannot reach; say why first.
      log::warn_once("cpu-strict:window", s.message());
    }
    return CommWindow(data, [this, opened = std::move(opened)] {
      regions_.close(opened);
      return Status::ok();
    });
  }

  uint64_t budget_bytes() const override { return options_.budget_bytes; }
  uint64_t bytes_in_use() const override { return blocks_.in_use(); }
  Ledger* ledger() const override { return options_.ledger; }

 protected:
  void release(void* data, uint64_t bytes, MemoryCategory category) override {
    if (options_.ledger) options_.ledger->sub(Tier::kDevice, category, bytes);
    blocks_.release(data, bytes);
  }

 private:
  // Enqueues `body` with the device allocations its operands lie in open to it (strict).
  template <typename Body>
  void run(Stream& stream, std::initializer_list<std::pair<const void*, uint64_t>> operands,
           Body body) {
    if (!options_.strict) {
      stream.enqueue([body = std::move(body)] {
        body();
        return Status::ok();
      });
      return;
    }
    std::vector<std::pair<const void*, uint64_t>> ops(operands);
    stream.enqueue([this, ops = std::move(ops), body = std::move(body)] {
      std::vector<uintptr_t> opened;
      Status s;
      for (const auto& op : ops) {
        s = regions_.open({op}, opened);
        if (!s.is_ok()) break;
      }
      if (s.is_ok()) body();  // an operand it cannot reach: the operation fails, nothing runs
      regions_.close(opened);
      return s;
    });
  }

  // A host copy into or out of strict device memory (either side may be the device's).
  Status copy_range(void* dst, const void* src, uint64_t bytes) {
    std::vector<uintptr_t> opened;
    Status s = regions_.open({{dst, bytes}, {src, bytes}}, opened);
    if (s.is_ok()) std::memcpy(dst, src, bytes);
    regions_.close(opened);
    return s;
  }

  // Device memory is mapped, not malloc'd (as a GPU allocator maps its own): a block dropped
  // from the cache goes back to the system at once. Strict memory starts unreachable.
  void* map(uint64_t bytes) {
    const int prot = options_.strict ? PROT_NONE : PROT_READ | PROT_WRITE;
    void* p = ::mmap(nullptr, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    if (options_.strict) regions_.add(p, bytes);
    return p;
  }
  void unmap(void* p, uint64_t bytes) {
    if (options_.strict) regions_.remove(p);
    ::munmap(p, bytes);
  }

  CpuDeviceOptions options_;
  Regions regions_;
  BlockCache blocks_;
};

}  // namespace

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCpuStrict:
      return "cpu-strict";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

std::optional<DeviceKind> parse_device_kind(std::string_view name) {
  for (DeviceKind k :
       {DeviceKind::kAuto, DeviceKind::kCpu, DeviceKind::kCpuStrict, DeviceKind::kCuda}) {
    if (name == device_kind_name(k)) return k;
  }
  return std::nullopt;
}

Result<DeviceKind> resolve_device_kind(DeviceKind kind) {
  if (kind != DeviceKind::kAuto) return kind;
  const char* env = std::getenv("ZINF_DEVICE");
  if (env == nullptr || *env == '\0') {
    return cuda_device_visible() ? DeviceKind::kCuda : DeviceKind::kCpu;
  }
  auto parsed = parse_device_kind(env);
  if (!parsed || *parsed == DeviceKind::kAuto) {
    return make_error(ErrorCode::kInvalidArgument,
                      "ZINF_DEVICE must be cpu, cpu-strict or cuda, got '{}'", env);
  }
  return *parsed;
}

int cuda_ordinal(int requested) {
  if (requested >= 0) return requested;
  const int gpus = cuda_device_count();
  if (gpus <= 0) return 0;
  // The local rank as the launchers give it (comm/env reads the same variables): torchrun,
  // Open MPI, Slurm.
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* local = std::getenv(name);
    if (local == nullptr || *local == '\0') continue;
    char* end = nullptr;
    const long r = std::strtol(local, &end, 10);
    if (end == local || *end != '\0' || r < 0) return 0;
    return static_cast<int>(r % gpus);
  }
  return 0;
}

#ifndef ZINF_HAVE_CUDA
bool cuda_device_visible() { return false; }
int cuda_device_count() { return 0; }
uint64_t cuda_free_bytes(int) { return 0; }

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions&) {
  return make_error(ErrorCode::kUnavailable,
                    "device cuda: this build of zinf has no CUDA (configure with nvcc on the path "
                    "and ZINF_CUDA=ON)");
}
#endif

std::unique_ptr<Device> make_cpu_device(const CpuDeviceOptions& options) {
  return std::make_unique<CpuDevice>(options);
}

Result<std::unique_ptr<Device>> make_device(DeviceKind kind, const DeviceOptions& options) {
  switch (kind) {
    case DeviceKind::kCpu:
    case DeviceKind::kCpuStrict:
      return make_cpu_device({.budget_bytes = options.budget_bytes,
                              .ledger = options.ledger,
                              .strict = kind == DeviceKind::kCpuStrict,
                              .threads = options.threads});
    case DeviceKind::kCuda:
      return make_cuda_device(options);
    case DeviceKind::kAuto:
      break;
  }
  return make_error(ErrorCode::kInvalidArgument, "make_device: resolve the device kind first ({})",
                    device_kind_name(kind));
}

}  // namespace zinf
