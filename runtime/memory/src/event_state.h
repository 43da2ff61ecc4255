// The shared state behind Event: completed by whichever backend's stream reaches it (a CPU
// stream's thread, a CUDA host function), waited on by host code.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "zinf/memory/device.h"

namespace zinf {

struct Event::State {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;
  Status status;
  // A backend's own event recorded at the same point (a cudaEvent_t), so that its streams can
  // wait on the device instead of in a host callback; null for CPU streams.
  std::shared_ptr<void> native;

  void complete(Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
};

}  // namespace zinf
