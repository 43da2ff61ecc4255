// Device, Stream, Event: the fastest tier behind one small contract (STYLE.md 3).
//
//  - A Device allocates byte-budgeted buffers (going over budget is ErrorCode::kOutOfMemory
//    naming the request and the budget, as on a GPU), creates streams, and copies
//    asynchronously on a stream between its memory and pinned host memory.
//  - A Stream runs its work in order. enqueue() and copy_async() never block the caller;
//    wait_for(event) makes later work on this stream wait for another stream's event without
//    blocking the host. Work reports a Status; the first failure on a stream is sticky: every
//    event recorded after it reports it, and synchronize() returns (and clears) it.
//  - An Event marks a point in a stream: ready(), wait() (blocks the host).
//
// CpuDevice implements the contract without a GPU (memory from the host heap under a budget,
// each stream a thread), so every tier path runs on CPU-only machines. CudaDevice (cudaMalloc,
// cudaStream_t, cudaEvent_t, cudaMemcpyAsync from pinned memory) lands with the CUDA work and
// keeps the same contract.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "zinf/core/status.h"
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
  // True when device memory is ordinary host memory (CpuDevice): host code may touch it.
  virtual bool host_addressable() const = 0;

  virtual Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) = 0;
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  // Asynchronous copy on `stream`; either side may be device memory or pinned host memory.
  virtual void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) = 0;

  virtual uint64_t budget_bytes() const = 0;
  virtual uint64_t bytes_in_use() const = 0;
  virtual Ledger* ledger() const = 0;

 protected:
  friend class DeviceBuffer;
  virtual void release(void* data, uint64_t bytes, MemoryCategory category) = 0;
};

struct CpuDeviceOptions {
  uint64_t budget_bytes = 1ull << 30;
  Ledger* ledger = nullptr;  // where allocations are accounted (Tier::kDevice); may be null
};

std::unique_ptr<Device> make_cpu_device(const CpuDeviceOptions& options);

}  // namespace zinf
