// A Device that forwards every operation to another (a real one), for tests that watch or hold
// back some of the calls: derive and override those.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "zinf/memory/device.h"

namespace zinf::test {

class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}

  void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) override {
    inner_->copy_async(dst, src, bytes, stream);
  }
  std::string name() const override { return inner_->name(); }
  Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) override {
    return inner_->allocate(bytes, category);  // the buffer frees itself through inner_
  }
  std::unique_ptr<Stream> create_stream(std::string name) override {
    return inner_->create_stream(std::move(name));
  }
  void fill(TensorRef dst, float value, Stream& stream) override {
    inner_->fill(dst, value, stream);
  }
  void accumulate(TensorRef acc, ConstTensorRef src, bool overwrite, Stream& stream) override {
    inner_->accumulate(acc, src, overwrite, stream);
  }
  void cast(TensorRef dst, ConstTensorRef src, Stream& stream) override {
    inner_->cast(dst, src, stream);
  }
  void scale(TensorRef x, float factor, bool* found_nonfinite, Stream& stream) override {
    inner_->scale(x, factor, found_nonfinite, stream);
  }
  void sum_squares_blocks(ConstTensorRef x, float factor, double* block_sums,
                          Stream& stream) override {
    inner_->sum_squares_blocks(x, factor, block_sums, stream);
  }
  void adam(const kernels::AdamConfig& config, const kernels::AdamStepArgs& args,
            const kernels::AdamTensors& tensors, Stream& stream) override {
    inner_->adam(config, args, tensors, stream);
  }
  CommWindow comm_window(void* data, uint64_t bytes, WindowAccess access) override {
    return inner_->comm_window(data, bytes, access);
  }
  std::optional<CommWindow> host_window(void* data, uint64_t bytes) override {
    return inner_->host_window(data, bytes);
  }
  uint64_t budget_bytes() const override { return inner_->budget_bytes(); }
  uint64_t bytes_in_use() const override { return inner_->bytes_in_use(); }
  Ledger* ledger() const override { return inner_->ledger(); }

  Status register_host(void* data, uint64_t bytes) override {
    return inner_->register_host(data, bytes);
  }
  void unregister_host(void* data) override { inner_->unregister_host(data); }

 protected:
  void release(void*, uint64_t, MemoryCategory) override {
    ZINF_CHECK(false, "a ForwardingDevice hands out its inner device's buffers only");
  }

  std::unique_ptr<Device> inner_;
};

}  // namespace zinf::test
