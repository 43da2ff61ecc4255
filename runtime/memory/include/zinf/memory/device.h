// Device, Stream, Event: the fastest tier, and a compute backend, behind one small contract
// (the shape of ggml-backend: buffer -> stream -> operations).
//
//  - A Device allocates byte-budgeted buffers (going over budget is ErrorCode::kOutOfMemory
//    naming the request and the budget, as on a GPU), creates streams, and runs operations on
//    them. Device memory is reached ONLY through these operations: host code never reads or
//    writes it (the strict CPU device makes any such access fault at once). The operations:
//    copies between device memory and host memory, fill, accumulate with dtype conversion, cast,
//    scale with a non-finite flag, deterministic blocked sum of squares, and Adam/AdamW over
//    device-resident state (kernels::adam_step's element function).
//  - Operands of an operation are the device's own memory or any host memory; results that the
//    host reads (the non-finite flag, the block sums) are written to host memory when the
//    operation runs. A backend whose kernels reach only pinned memory (CUDA) stages pageable
//    operands through pinned buffers of its own; pinned ones (PinnedPool) are reached directly.
//    An operation's operands belong to it from the call until an event recorded after it
//    completes.
//  - A Stream runs its operations in order. Enqueueing never blocks the caller; wait_for(event)
//    makes later work on this stream wait for another stream's event without blocking the host.
//    Work reports a Status; the first failure on a stream is sticky: every event recorded after
//    it reports it, and synchronize() returns (and clears) it.
//  - An Event marks a point in a stream: ready(), wait() (blocks the host).
//  - Communicators that run on the host (local threads, MPI, Gloo) reach device memory only
//    through a CommWindow: while it lives the communicator uses window.data() in place of the
//    range: the range itself where the host reaches the device's memory (the CPU device), a host
//    copy of it where it does not (CUDA; and the strict CPU device, which so proves in CI that
//    callers use the window's address and declare how they use it). The caller opens a window
//    after the operations that write the range have completed, closes it (close(), which reports
//    a failed copy back) before operations use the range again, and says what the collective
//    does with it (WindowAccess): what it reads is copied in as the window opens, what it writes
//    is copied back as it closes. A communicator that reaches device memory natively (NCCL) is
//    given the range itself, with no window.
//  - The one other exception is a model that computes on the host over a device whose memory is
//    host memory (the CPU device): host_window() lends it a range in place (no copies), and a
//    device whose memory the host cannot reach (CUDA) declines.
//
// CpuDevice implements the contract without a GPU (memory mapped from the system under a budget,
// each stream a thread, the operations calling the SIMD kernels of kernels/), so every tier
// path runs on CPU-only machines. Its strict variant maps its memory PROT_NONE except while an
// operation (or a host_window) uses it, and gives comm windows staged copies as CUDA does.
// CudaDevice (kernels/, docs/gpu.md) keeps the same contract.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/accounting.h"

namespace zinf {

class Event {
 public:
  Event();  // an event that is already complete and ok
  bool ready() const;
  Status wait() const;

  struct State;
  explicit Event(std::shared_ptr<State> state) : state_(std::move(state)) {}
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

// An operand of a device operation: `numel` elements of `dtype` at `data`, in the device's
// memory or in host memory. Host code must not dereference `data` when it is device memory.
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  uint64_t numel = 0;
  uint64_t bytes() const { return numel * dtype_size(dtype); }
};
struct ConstTensorRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  uint64_t numel = 0;
  ConstTensorRef() = default;
  ConstTensorRef(const void* d, DType t, uint64_t n) : data(d), dtype(t), numel(n) {}
  ConstTensorRef(const TensorRef& r) : data(r.data), dtype(r.dtype), numel(r.numel) {}  // NOLINT
  uint64_t bytes() const { return numel * dtype_size(dtype); }
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
  // Host work run in order on the stream (cudaLaunchHostFunc under CUDA).
  virtual void enqueue(std::function<Status()> work) = 0;
  virtual Event record() = 0;
  virtual void wait_for(const Event& event) = 0;
  virtual Status synchronize() = 0;
};

class Device;

// A device allocation; frees itself (and its accounting) when destroyed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, uint64_t bytes, MemoryCategory category)
      : device_(device), data_(data), bytes_(bytes), category_(category) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void reset();
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  MemoryCategory category() const { return category_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::kBuffers;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;

  virtual Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) = 0;
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;

  // ---- operations, enqueued on a stream (the contract above) ----
  // Copies `bytes`; either side may be device memory or host memory.
  virtual void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) = 0;
  // dst[i] = value converted to dst.dtype.
  virtual void fill(TensorRef dst, float value, Stream& stream) = 0;
  // acc[i] += (float)src[i] (acc is fp32; src any dtype, src.numel == acc.numel). With
  // `overwrite`, acc[i] = 0.0f + (float)src[i] and acc is not read (kernels::accumulate).
  virtual void accumulate(TensorRef acc, ConstTensorRef src, bool overwrite, Stream& stream) = 0;
  // dst[i] = src[i] converted to dst.dtype (round to nearest even); equal numel.
  virtual void cast(TensorRef dst, ConstTensorRef src, Stream& stream) = 0;
  // x[i] *= factor in place; then *found_nonfinite (host memory, may be null) is set to whether
  // any element is inf or NaN.
  virtual void scale(TensorRef x, float factor, bool* found_nonfinite, Stream& stream) = 0;
  // block_sums[b] = sum over block b of ((double)(float)x[i] * factor)^2, blocks of
  // kernels::kSumSquaresBlockElems elements (host memory, kernels::sum_squares_block_count(n)
  // doubles). Fixed blocks make the total independent of threads and of how x is cut.
  virtual void sum_squares_blocks(ConstTensorRef x, float factor, double* block_sums,
                                  Stream& stream) = 0;
  // One Adam/AdamW step over device-resident state (kernels::adam_step; the same element
  // function on every backend, so the results are bit-identical to the CPU's).
  virtual void adam(const kernels::AdamConfig& config, const kernels::AdamStepArgs& args,
                    const kernels::AdamTensors& tensors, Stream& stream) = 0;

  // What a host-side communicator does with a window's range.
  enum class WindowAccess : uint8_t {
    kRead,       // reads what the range held when the window opened (a collective's input)
    kWrite,      // writes the whole range; what it held before is not read (an output)
    kReadWrite,  // both (an in-place collective, or an output holding its own input)
  };

  // A window through which a host-side communicator reaches [data, data + bytes) of device
  // memory at data() until the window closes (see the contract above).
  class CommWindow {
   public:
    CommWindow() = default;
    // A window at `data`: the range itself, or a host copy whose `close` writes it back.
    explicit CommWindow(void* data, std::function<Status()> close = nullptr)
        : data_(data), close_(std::move(close)) {}
    CommWindow(CommWindow&& o) noexcept
        : data_(std::exchange(o.data_, nullptr)), close_(std::exchange(o.close_, nullptr)) {}
    CommWindow& operator=(CommWindow&& o) noexcept {
      if (this != &o) {
        reset();
        data_ = std::exchange(o.data_, nullptr);
        close_ = std::exchange(o.close_, nullptr);
      }
      return *this;
    }
    CommWindow(const CommWindow&) = delete;
    CommWindow& operator=(const CommWindow&) = delete;
    ~CommWindow() { reset(); }

    // Where the communicator reads and writes the range while the window is open.
    void* data() const { return data_; }
    // Ends the window: what the communicator wrote reaches the device's memory, or the failure
    // says why it did not. Once only; later calls return ok.
    Status close() {
      data_ = nullptr;
      if (!close_) return Status::ok();
      return std::exchange(close_, nullptr)();
    }
    // close() for a window whose result no longer matters (an abandoned operation): a failure
    // is logged, not returned.
    void reset();

   private:
    void* data_ = nullptr;
    std::function<Status()> close_;
  };
  virtual CommWindow comm_window(void* data, uint64_t bytes, WindowAccess access) = 0;

  // A model that computes on the host (the GPT's CPU model) reaches [data, data + bytes) of device
  // memory in place while the returned window lives, on a device whose memory is host memory: the
  // CPU device (its strict variant opens the range itself while the window lives). Empty where
  // host code cannot reach device memory (CUDA): the model copies through the operations instead.
  // The caller opens the window only after the operations that write the range have completed (it
  // synchronises their stream), and ends its own accesses before the window closes.
  virtual std::optional<CommWindow> host_window(void* data, uint64_t bytes) {
    (void)data;
    (void)bytes;
    return std::nullopt;
  }

  // Host memory the engine's host tier hands to this device's operations (PinnedPool buffers) is
  // registered once when it is allocated and unregistered before it goes back to the system: CUDA
  // pins it (cudaHostRegister), so its kernels and copies reach it in place. The CPU device needs
  // nothing.
  virtual Status register_host(void* data, uint64_t bytes) {
    (void)data;
    (void)bytes;
    return Status::ok();
  }
  virtual void unregister_host(void* data) { (void)data; }

  virtual uint64_t budget_bytes() const = 0;
  virtual uint64_t bytes_in_use() const = 0;
  virtual Ledger* ledger() const = 0;

 protected:
  friend class DeviceBuffer;
  virtual void release(void* data, uint64_t bytes, MemoryCategory category) = 0;
};

// Element types of device memory as the typed views name them (bit patterns, never dereferenced
// by host code on device memory).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
// The dtype of an element type; only float, BFloat16 and Float16 have one (anything else does not
// compile: a view is never reinterpreted as another type).
template <typename T>
struct ElementDType;
template <>
struct ElementDType<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct ElementDType<BFloat16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct ElementDType<Float16> {
  static constexpr DType value = DType::kF16;
};
template <typename T>
inline constexpr DType element_dtype = ElementDType<std::remove_const_t<T>>::value;

// Which device the engine computes on.
enum class DeviceKind : uint8_t {
  kAuto,       // $ZINF_DEVICE when set (cpu, cpu-strict, cuda), else cuda where a GPU is
               // visible to a build with CUDA, else cpu
  kCpu,        // CpuDevice
  kCpuStrict,  // CpuDevice with strict = true: every host access to device memory faults
  kCuda,       // CudaDevice on one GPU (a build with CUDA and a visible GPU; else an error)
};
std::string_view device_kind_name(DeviceKind kind);
std::optional<DeviceKind> parse_device_kind(std::string_view name);
// kAuto resolved from the environment; an unknown $ZINF_DEVICE is an error naming it.
Result<DeviceKind> resolve_device_kind(DeviceKind kind);
// Whether this build has CUDA and a GPU is visible (no driver, no device: false).
bool cuda_device_visible();
// The GPUs visible to this build (0 without CUDA, a driver or a device).
int cuda_device_count();
// Free memory of GPU `ordinal` now (cudaMemGetInfo); 0 when it cannot be read.
uint64_t cuda_free_bytes(int ordinal);

struct CpuDeviceOptions {
  uint64_t budget_bytes = 1ull << 30;
  Ledger* ledger = nullptr;  // where allocations are accounted (Tier::kDevice); may be null
  // Memory unreachable to host code outside the device's operations and comm windows
  // (PROT_NONE otherwise): a stray host access faults at once. For tests; slower.
  bool strict = false;
  int threads = 0;  // threads of the operations' kernels; 0 = all
};

std::unique_ptr<Device> make_cpu_device(const CpuDeviceOptions& options);

// The device of a kind (resolved: not kAuto) under a budget; the one place a backend is chosen,
// so a new backend (CUDA) adds a kind here and nothing above runtime/memory changes.
struct DeviceOptions {
  uint64_t budget_bytes = 1ull << 30;
  Ledger* ledger = nullptr;
  int threads = 0;   // CPU kinds: threads of the operations' kernels; 0 = all
  int ordinal = -1;  // CUDA: the GPU; -1 = cuda_ordinal(-1)
};
Result<std::unique_ptr<Device>> make_device(DeviceKind kind, const DeviceOptions& options);
// The GPU a rank uses: `requested` when >= 0, else the launcher's local rank ($LOCAL_RANK,
// $OMPI_COMM_WORLD_LOCAL_RANK or $SLURM_LOCALID, as comm/env reads them) modulo the visible GPUs,
// else 0. One GPU per local rank, the same one NCCL takes.
int cuda_ordinal(int requested);
// The CUDA device (GPU options.ordinal): memory from cudaMallocManaged under the budget (host-side
// communicators reach it through comm windows), streams and events on cudaStream_t, operations
// as the kernels of zinf/kernels/cuda_ops.h. kUnavailable, naming why, in a build without CUDA
// or where no GPU is visible.
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options);

}  // namespace zinf
