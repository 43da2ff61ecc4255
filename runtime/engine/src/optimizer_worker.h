// One thread that runs optimizer jobs in submission order: the updates fused into the backward
// pass (FusedUpdates) or the walk behind step() (BehindWalk). A job's failure is kept until the
// next wait(); jobs after it still run (each decides from the engine's state whether to work).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "zinf/core/status.h"

namespace zinf::engine_detail {

class OptimizerWorker {
 public:
  OptimizerWorker() : thread_([this] { run(); }) {}
  OptimizerWorker(const OptimizerWorker&) = delete;
  OptimizerWorker& operator=(const OptimizerWorker&) = delete;
  // Runs what was submitted, then stops.
  ~OptimizerWorker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void submit(std::function<Status()> job) {
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  // Waits until every submitted job has run; the first failure since the last wait.
  Status wait() {
    std::unique_lock lk(mu_);
    idle_cv_.wait(lk, [&] { return jobs_.empty() && !busy_; });
    return std::exchange(first_error_, Status());
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lk.unlock();
      Status st = job();
      lk.lock();
      busy_ = false;
      if (!st.is_ok() && first_error_.is_ok()) first_error_ = std::move(st);
      if (jobs_.empty()) idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> jobs_;
  bool busy_ = false, stop_ = false;
  Status first_error_;
  std::thread thread_;
};

}  // namespace zinf::engine_detail
