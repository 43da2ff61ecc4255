// Chrome/Perfetto trace of what the runtime does: one track per stream of work (per rank:
// compute, comm, copy, nvme read, nvme write, cpu adam), one complete event per operation, named
// after the unit or tensor. Off by default; when off an event costs one relaxed atomic load.
//
//   trace::start("run.json");  ...  trace::stop();   // then open in ui.perfetto.dev
#pragma once

#include <chrono>
#include <string>

#include "zinf/core/status.h"

namespace zinf::trace {

bool enabled();
// Starts recording (clears what was recorded before). The file is written by stop().
void start(std::string path);
// Writes {"traceEvents": [...]} to the path given to start() and stops recording.
Status stop();

using Clock = std::chrono::steady_clock;
// Records a complete event on `track` from `begin` to now.
void complete(const std::string& track, const std::string& name, Clock::time_point begin);

// Records from construction to destruction (when tracing is on).
class Span {
 public:
  Span(std::string track, std::string name)
      : on_(enabled()), begin_(on_ ? Clock::now() : Clock::time_point{}) {
    if (on_) {
      track_ = std::move(track);
      name_ = std::move(name);
    }
  }
  ~Span() {
    if (on_) complete(track_, name_, begin_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool on_;
  Clock::time_point begin_;
  std::string track_, name_;
};

}  // namespace zinf::trace
