#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "zinf/core/units.h"
#include "zinf/memory/device.h"

namespace zinf {

struct Event::State {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;
  Status status;

  void complete(Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
};

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

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& o) : options_(o) {}
  ~CpuDevice() override {
    for (auto& [size, p] : cache_) std::free(p);
  }

  std::string name() const override { return "cpu"; }
  bool host_addressable() const override { return true; }

  Result<DeviceBuffer> allocate(uint64_t bytes, MemoryCategory category) override {
    if (bytes == 0) return DeviceBuffer();
    uint64_t padded = align_up(bytes, 4096);
    void* p = nullptr;
    {
      std::lock_guard lock(mu_);
      // Freed blocks are kept mapped and reused by requests of the same size (as a GPU caching
      // allocator does): fresh pages would cost a page fault each on first touch.
      if (auto it = cache_.find(padded); it != cache_.end()) {
        p = it->second;
        cache_.erase(it);
        cached_ -= padded;
      } else {
        // The budget covers blocks in use and cached ones; drop cached blocks to make room.
        while (in_use_ + cached_ + padded > options_.budget_bytes && !cache_.empty()) {
          auto last = std::prev(cache_.end());
          std::free(last->second);
          cached_ -= last->first;
          cache_.erase(last);
        }
        if (in_use_ + padded > options_.budget_bytes) {
          return make_error(ErrorCode::kOutOfMemory,
                            "device budget exhausted: {} requested for {} while {} of the {} "
                            "budget is in use",
                            format_bytes(static_cast<double>(bytes)), category_name(category),
                            format_bytes(static_cast<double>(in_use_)),
                            format_bytes(static_cast<double>(options_.budget_bytes)));
        }
      }
      in_use_ += padded;
    }
    if (p == nullptr) p = std::aligned_alloc(4096, padded);
    if (p == nullptr) {
      std::lock_guard lock(mu_);
      in_use_ -= padded;
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
    stream.enqueue([dst, src, bytes] {
      std::memcpy(dst, src, bytes);
      return Status::ok();
    });
  }

  uint64_t budget_bytes() const override { return options_.budget_bytes; }
  uint64_t bytes_in_use() const override {
    std::lock_guard lock(mu_);
    return in_use_;
  }
  Ledger* ledger() const override { return options_.ledger; }

 protected:
  void release(void* data, uint64_t bytes, MemoryCategory category) override {
    if (options_.ledger) options_.ledger->sub(Tier::kDevice, category, bytes);
    std::lock_guard lock(mu_);
    in_use_ -= bytes;
    cache_.emplace(bytes, data);
    cached_ += bytes;
  }

 private:
  CpuDeviceOptions options_;
  mutable std::mutex mu_;
  uint64_t in_use_ = 0;
  uint64_t cached_ = 0;
  std::multimap<uint64_t, void*> cache_;  // size -> freed block kept for reuse
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(const CpuDeviceOptions& options) {
  return std::make_unique<CpuDevice>(options);
}

}  // namespace zinf
