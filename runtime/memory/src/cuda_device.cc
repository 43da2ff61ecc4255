// CudaDevice: the device contract (zinf/memory/device.h) on GPU 0.
//
//  - memory: cudaMalloc under the budget, cached for reuse and accounted like the CPU device's
//    (no cudaFree, which synchronises the device, on the hot path). Device memory, not managed
//    memory: copies to and from pinned host memory run about 9 % faster into it (docs/gpu.md,
//    measured on an H200), and nothing pages behind the budget's back;
//  - comm windows: host-side communicators (local threads, MPI, Gloo) work in pinned host
//    copies, copied in as a window opens (what the collective reads) and back as it closes (what
//    it writes); the copies' buffers are kept for reuse up to the most ever open at once. NCCL
//    reaches device memory itself (the engine opens no window for it);
//  - streams: non-blocking cudaStream_t; host work runs as cudaLaunchHostFunc; an Event recorded
//    on a CUDA stream carries a cudaEvent_t, so CUDA streams wait for each other on the device and
//    only events of CPU streams are waited for in a host function;
//  - operations: the kernels of zinf/kernels/cuda_ops.h, which compute what the CPU backend
//    computes bit for bit (tests/gpu); results the contract puts in host memory (the non-finite
//    flag, the block sums) go through a per-stream managed scratch area and are copied out by a
//    host function in stream order.
#include "zinf/kernels/cuda_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "block_cache.h"
#include "event_state.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/kernels/cuda_ops.h"
#include "zinf/memory/device.h"

namespace zinf {
namespace {

Status cuda_status(const char* what, cudaError_t err) {
  return make_error(ErrorCode::kIo, "{}: {}", what, cudaGetErrorString(err));
}

// The CUDA runtime's current device is per host thread, and the engine's threads (ranks, movers,
// the runtime's host-function thread) share one device object: every entry point that calls CUDA
// makes the device's GPU current first (a no-op when it already is).
void bind(int ordinal) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != ordinal) (void)cudaSetDevice(ordinal);
}

class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int ordinal) : name_(std::move(name)), ordinal_(ordinal) {
    bind(ordinal_);
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        err != cudaSuccess) {
      fail(cuda_status("cudaStreamCreate", err));
      stream_ = nullptr;
    }
  }
  ~CudaStream() override {
    if (stream_ == nullptr) return;
    bind(ordinal_);
    (void)cudaStreamSynchronize(stream_);
    empty_retired();
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    (void)cudaStreamDestroy(stream_);
  }

  const std::string& name() const override { return name_; }
  cudaStream_t handle() const { return stream_; }

  void enqueue(std::function<Status()> work) override {
    bind(ordinal_);
    auto* item = new Item{this, std::move(work)};
    if (cudaError_t err = cudaLaunchHostFunc(stream_, &run_item, item); err != cudaSuccess) {
      delete item;
      fail(cuda_status("cudaLaunchHostFunc", err));
    }
  }

  Event record() override {
    bind(ordinal_);
    auto state = std::make_shared<Event::State>();
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
      if (cudaEventRecord(ev, stream_) == cudaSuccess) {
        state->native = std::shared_ptr<void>(
            ev, [](void* e) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
      } else {
        (void)cudaEventDestroy(ev);
      }
    }
    // The host function must not drop the last reference to the state: its cudaEvent_t would be
    // destroyed there, and no CUDA call may run inside a host function. It hands its reference
    // to `retired_`, which a later call on an ordinary thread empties.
    enqueue([this, state]() mutable {
      state->complete(sticky());
      std::lock_guard lock(mu_);
      retired_.push_back(std::move(state));
      return Status::ok();
    });
    empty_retired();
    return Event(state);
  }

  void wait_for(const Event& event) override {
    bind(ordinal_);
    if (const auto& native = event.state()->native) {
      const cudaError_t err = cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(native.get()));
      if (err != cudaSuccess) fail(cuda_status("cudaStreamWaitEvent", err));
      return;
    }
    enqueue([event] { return event.wait(); });
  }

  Status synchronize() override {
    bind(ordinal_);
    const cudaError_t err = cudaStreamSynchronize(stream_);
    empty_retired();
    std::lock_guard lock(mu_);
    Status s = std::exchange(sticky_, Status::ok());
    if (err != cudaSuccess && s.is_ok()) s = cuda_status("cudaStreamSynchronize", err);
    return s;
  }

  // The first failure since the last synchronize().
  void fail(Status s) {
    std::lock_guard lock(mu_);
    if (sticky_.is_ok()) sticky_ = std::move(s);
  }
  void fail_if(const std::string& launch_error) {
    if (!launch_error.empty()) fail(make_error(ErrorCode::kIo, "{}", launch_error));
  }

  // Managed scratch of at least `bytes`, reused by this stream's operations in stream order
  // (the host function copying a result out runs before the next kernel writes it).
  void* scratch(uint64_t bytes) {
    if (bytes > scratch_bytes_) {
      bind(ordinal_);
      (void)cudaStreamSynchronize(stream_);  // nothing in flight still uses the old area
      if (scratch_ != nullptr) (void)cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      if (cudaError_t err = cudaMallocManaged(&scratch_, bytes); err != cudaSuccess) {
        fail(cuda_status("cudaMallocManaged (stream scratch)", err));
        return nullptr;
      }
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

 private:
  struct Item {
    CudaStream* stream;
    std::function<Status()> work;
  };
  static void CUDART_CB run_item(void* p) {
    // No CUDA call may be made here (a host function): the work is host code only.
    std::unique_ptr<Item> item(static_cast<Item*>(p));
    Status s = item->work();
    if (!s.is_ok()) item->stream->fail(std::move(s));
  }
  Status sticky() const {
    std::lock_guard lock(mu_);
    return sticky_;
  }
  // Drops the event states the host functions handed over (outside the lock: a state's last
  // reference destroys its cudaEvent_t).
  void empty_retired() {
    std::vector<std::shared_ptr<Event::State>> done;
    {
      std::lock_guard lock(mu_);
      done.swap(retired_);
    }
  }

  std::string name_;
  int ordinal_ = 0;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mu_;
  Status sticky_;
  std::vector<std::shared_ptr<Event::State>> retired_;  // see record()
  void* scratch_ = nullptr;
  uint64_t scratch_bytes_ = 0;
};

CudaStream& as_cuda(Stream& s) { return static_cast<CudaStream&>(s); }

class CudaDevice final : public Device {
 public:
  CudaDevice(const DeviceOptions& options, int ordinal)
      : options_(options), ordinal_(ordinal), blocks_(options.budget_bytes) {}

  std::string name() const override { return "cuda:" + std::to_string(ordinal_); }

  ~CudaDevice() override {
    bind(ordinal_);
    for (const BlockCache::Block& b : blocks_.drain()) (void)cudaFree(b.data);
    for (auto& [size, p] : staging_cache_) (void)cudaFreeHost(p);
  }

  // A caching allocator, as the CPU device's (block_cache.h): no call into CUDA for a reused
  // block (cudaFree synchronises the whole device, which would stall every stream at each
  // released unit).
  Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) override {
    if (bytes == 0) return DeviceBuffer();
    const uint64_t padded = align_up(bytes, 4096);
    ZINF_ASSIGN_OR_RETURN(BlockCache::Reservation r, blocks_.reserve(padded, padded, category));
    if (!r.evicted.empty()) {
      bind(ordinal_);
      for (const BlockCache::Block& b : r.evicted) (void)cudaFree(b.data);
    }
    void* p = r.reused;
    if (p == nullptr) {
      bind(ordinal_);
      if (cudaError_t err = cudaMalloc(&p, padded); err != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: the next request may fit
        blocks_.unreserve(padded);
        return make_error(ErrorCode::kOutOfMemory, "cudaMalloc of {} for {}: {}",
                          format_bytes(static_cast<double>(padded)), category_name(category),
                          cudaGetErrorString(err));
      }
    }
    if (options_.ledger) options_.ledger->add(Tier::kDevice, category, padded);
    return DeviceBuffer(this, p, padded, category);
  }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CudaStream>(std::move(name), ordinal_);
  }

  void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) override {
    CudaStream& s = on(stream);
    if (bytes == 0) return;
    if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.handle());
        err != cudaSuccess) {
      s.fail(cuda_status("cudaMemcpyAsync", err));
    }
  }

  void fill(TensorRef dst, float value, Stream& stream) override {
    CudaStream& s = on(stream);
    s.fail_if(kernels::cuda::fill(s.handle(), dst.data, dst.dtype, dst.numel, value));
  }

  void accumulate(TensorRef acc, ConstTensorRef src, bool overwrite, Stream& stream) override {
    CudaStream& s = on(stream);
    if (acc.dtype != DType::kF32 || acc.numel != src.numel) {
      s.fail(make_error(ErrorCode::kInvalidArgument,
                        "accumulate: the accumulator must be fp32 and as long as the source"));
      return;
    }
    s.fail_if(kernels::cuda::accumulate(s.handle(), static_cast<float*>(acc.data), src.data,
                                        src.dtype, acc.numel, overwrite));
  }

  // A pageable host operand (a model's host copy: params_to_host, grads_from_host) is staged
  // through the stream's scratch area, which the kernel reaches: copied in before, out after.
  void cast(TensorRef dst, ConstTensorRef src, Stream& stream) override {
    CudaStream& s = on(stream);
    if (dst.numel != src.numel) {
      s.fail(make_error(ErrorCode::kInvalidArgument, "cast: {} elements into {}", src.numel,
                        dst.numel));
      return;
    }
    const bool stage_src = pageable(src.data), stage_dst = pageable(dst.data);
    if (!stage_src && !stage_dst) {
      s.fail_if(
          kernels::cuda::cast(s.handle(), dst.data, dst.dtype, src.data, src.dtype, dst.numel));
      return;
    }
    const uint64_t src_bytes = align_up(src.bytes(), 256);
    char* scratch = static_cast<char*>(s.scratch(src_bytes + dst.bytes()));
    if (scratch == nullptr) return;
    const void* from = src.data;
    void* to = stage_dst ? scratch + src_bytes : dst.data;
    if (stage_src) {
      copy_async(scratch, src.data, src.bytes(), stream);
      from = scratch;
    }
    s.fail_if(kernels::cuda::cast(s.handle(), to, dst.dtype, from, src.dtype, dst.numel));
    if (stage_dst) copy_async(dst.data, to, dst.bytes(), stream);
  }

  void scale(TensorRef x, float factor, bool* found_nonfinite, Stream& stream) override {
    CudaStream& s = on(stream);
    int* flag = nullptr;
    if (found_nonfinite != nullptr) {
      flag = static_cast<int*>(s.scratch(sizeof(int)));
      if (flag == nullptr) return;
      s.fail_if(kernels::cuda::fill(s.handle(), flag, DType::kF32, 1, 0.0f));  // 0.0f bits: 0
    }
    s.fail_if(kernels::cuda::scale(s.handle(), x.data, x.dtype, x.numel, factor, flag));
    if (flag != nullptr) {
      s.enqueue([flag, found_nonfinite] {
        *found_nonfinite = *flag != 0;
        return Status::ok();
      });
    }
  }

  void sum_squares_blocks(ConstTensorRef x, float factor, double* block_sums,
                          Stream& stream) override {
    CudaStream& s = on(stream);
    const uint64_t blocks = kernels::sum_squares_block_count(x.numel);
    if (blocks == 0) return;
    auto* sums = static_cast<double*>(s.scratch(blocks * sizeof(double)));
    if (sums == nullptr) return;
    s.fail_if(
        kernels::cuda::sum_squares_blocks(s.handle(), x.data, x.dtype, x.numel, factor, sums));
    s.enqueue([sums, block_sums, blocks] {
      std::copy(sums, sums + blocks, block_sums);
      return Status::ok();
    });
  }

  void adam(const kernels::AdamConfig& config, const kernels::AdamStepArgs& args,
            const kernels::AdamTensors& t, Stream& stream) override {
    CudaStream& s = on(stream);
    s.fail_if(kernels::cuda::adam(s.handle(), kernels::adam_coeffs(config, args), t.param, t.m, t.v,
                                  t.grad, t.grad_dtype, t.param_copy, t.copy_dtype, t.n, nullptr));
  }

  // A host-side communicator cannot reach device memory: it works in a pinned host copy. The
  // caller has completed the operations that write the range (the contract), so the copies need
  // no stream: cudaMemcpy from and to pinned memory returns when they are done.
  CommWindow comm_window(void* data, uint64_t bytes, WindowAccess access) override {
    if (data == nullptr || bytes == 0) return CommWindow(data);
    bind(ordinal_);
    std::shared_ptr<void> copy = staging(bytes);
    Status in;
    if (access != WindowAccess::kWrite) {
      if (cudaError_t err = cudaMemcpy(copy.get(), data, bytes, cudaMemcpyDeviceToHost);
          err != cudaSuccess) {
        in = cuda_status("cudaMemcpy into a communicator's window", err);
      }
    }
    if (access == WindowAccess::kRead && in.is_ok()) {
      return CommWindow(copy.get(), [copy] { return Status::ok(); });
    }
    return CommWindow(copy.get(), [this, copy, data, bytes, access, in] {
      if (!in.is_ok()) return in;  // the collective read garbage: its result is not written
      if (access == WindowAccess::kRead) return Status::ok();
      bind(ordinal_);
      if (cudaError_t err = cudaMemcpy(data, copy.get(), bytes, cudaMemcpyHostToDevice);
          err != cudaSuccess) {
        return cuda_status("cudaMemcpy of a communicator's window back to the device", err);
      }
      // From pinned memory cudaMemcpy returns when the copy is done; from pageable memory (the
      // fallback in staging()) it may return before the DMA has landed, and the engine's
      // non-blocking streams do not wait for the default stream: wait for it here.
      if (cudaError_t err = cudaStreamSynchronize(nullptr); err != cudaSuccess) {
        return cuda_status("cudaMemcpy of a communicator's window back to the device", err);
      }
      return Status::ok();
    });
  }

  // Pinned and mapped: the kernels of the operations read and write host-tier buffers in place
  // (through unified addressing), and copies to and from them run at full speed.
  Status register_host(void* data, uint64_t bytes) override {
    bind(ordinal_);
    if (cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterMapped);
        err != cudaSuccess) {
      return cuda_status("cudaHostRegister", err);
    }
    return Status::ok();
  }
  void unregister_host(void* data) override {
    bind(ordinal_);
    (void)cudaHostUnregister(data);
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
  // Host memory that CUDA has not registered: its kernels cannot reach it (the host tier's
  // buffers are registered; a model's own host arrays are not).
  static bool pageable(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;
    }
    return a.type == cudaMemoryTypeUnregistered;
  }

  // A pinned buffer of at least `bytes` for a comm window, given back to the cache when the
  // window's last reference goes. The cache keeps what the windows open at the busiest moment
  // needed, no more: freed buffers beyond that high-water mark go back to the system.
  std::shared_ptr<void> staging(uint64_t bytes) {
    const uint64_t padded = align_up(bytes, 4096);
    void* p = nullptr;
    {
      std::lock_guard lock(staging_mu_);
      // Any cached buffer large enough: the cache never holds more than the peak, and a new
      // allocation beside an unsuitable-looking one would only churn (cudaFreeHost synchronises
      // the device).
      if (auto it = staging_cache_.lower_bound(padded); it != staging_cache_.end()) {
        p = it->second;
        staging_cached_ -= it->first;
        staging_open_ += it->first;
        const uint64_t size = it->first;
        staging_cache_.erase(it);
        staging_peak_ = std::max(staging_peak_, staging_open_);
        return std::shared_ptr<void>(p, [this, size](void* q) { unstage(q, size); });
      }
    }
    if (cudaError_t err = cudaHostAlloc(&p, padded, cudaHostAllocDefault); err != cudaSuccess) {
      // Pinned memory is limited (RLIMIT_MEMLOCK in containers): pageable memory works too,
      // at the slower speed of a staged copy.
      (void)cudaGetLastError();
      log::warn_once(
          "cuda:window-pinned",
          fmt::format("cudaHostAlloc of {} for a communicator's window failed ({}): "
                      "pageable memory instead",
                      format_bytes(static_cast<double>(padded)), cudaGetErrorString(err)));
      void* q = std::malloc(padded);
      ZINF_CHECK(q != nullptr, "out of host memory for a communicator's window of {}",
                 format_bytes(static_cast<double>(padded)));
      return std::shared_ptr<void>(q, [](void* r) { std::free(r); });
    }
    std::lock_guard lock(staging_mu_);
    staging_open_ += padded;
    staging_peak_ = std::max(staging_peak_, staging_open_);
    return std::shared_ptr<void>(p, [this, padded](void* q) { unstage(q, padded); });
  }
  void unstage(void* p, uint64_t size) {
    std::vector<void*> freed;
    {
      std::lock_guard lock(staging_mu_);
      staging_open_ -= size;
      staging_cache_.emplace(size, p);
      staging_cached_ += size;
      while (staging_open_ + staging_cached_ > staging_peak_ && !staging_cache_.empty()) {
        auto smallest = staging_cache_.begin();
        staging_cached_ -= smallest->first;
        freed.push_back(smallest->second);
        staging_cache_.erase(smallest);
      }
    }
    for (void* q : freed) (void)cudaFreeHost(q);
  }

  // The stream of an operation, with this device's GPU made current for the launch.
  CudaStream& on(Stream& stream) const {
    bind(ordinal_);
    return as_cuda(stream);
  }

  DeviceOptions options_;
  int ordinal_ = 0;
  BlockCache blocks_;
  // Pinned buffers of comm windows (staging()).
  std::mutex staging_mu_;
  std::multimap<uint64_t, void*> staging_cache_;  // size -> free buffer
  uint64_t staging_open_ = 0, staging_cached_ = 0, staging_peak_ = 0;
};

}  // namespace

int cuda_device_count() {
  static const int count = kernels::cuda::device_count();  // asked once per process
  return count;
}

bool cuda_device_visible() { return cuda_device_count() > 0; }

uint64_t cuda_free_bytes(int ordinal) {
  if (ordinal < 0 || ordinal >= cuda_device_count()) return 0;
  bind(ordinal);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return free;
}

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options) {
  const int gpus = cuda_device_count();
  if (gpus == 0) {
    return make_error(
        ErrorCode::kUnavailable,
        "device cuda: no CUDA device is visible (no GPU, or no driver); run on the CPU "
        "device instead (ZINF_DEVICE=cpu)");
  }
  const int ordinal = cuda_ordinal(options.ordinal);
  if (ordinal >= gpus) {
    return make_error(ErrorCode::kInvalidArgument, "device cuda:{}: only {} GPU{} visible", ordinal,
                      gpus, gpus == 1 ? " is" : "s are");
  }
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    return cuda_status("device cuda: cudaSetDevice", err);
  }
  int concurrent = 0;
  (void)cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, ordinal);
  if (!concurrent) {
    log::warn_once("cuda:managed",
                   "device cuda: this GPU has no concurrent managed access; host-side "
                   "communicators touching device memory will serialise with the GPU");
  }
  return std::unique_ptr<Device>(std::make_unique<CudaDevice>(options, ordinal));
}

}  // namespace zinf
