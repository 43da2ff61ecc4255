#include "zinf/sched/scheduler.h"

#include <algorithm>

#include "zinf/core/status.h"

namespace zinf::sched {

Scheduler::Scheduler(SchedulerOptions options, std::vector<uint64_t> unit_elements)
    : options_(options), elements_(std::move(unit_elements)), live_(elements_.size(), false) {
  options_.read_ahead_factor = std::max<uint64_t>(options_.read_ahead_factor, 1);
}

Use Scheduler::on_use(size_t unit) {
  ZINF_CHECK(unit < elements_.size(), "unit {} of {}", unit, elements_.size());
  if (!following_) {
    trace_.push_back(unit);
    ++position_;
    return Use::kRecording;
  }
  if (position_ < trace_.size() && trace_[position_] == unit) {
    ++position_;
    return Use::kFollowing;
  }
  // The uses so far matched; they and this one start the new trace.
  trace_.resize(position_);
  trace_.push_back(unit);
  ++position_;
  following_ = false;
  ++departures_;
  return Use::kDeparted;
}

bool Scheduler::on_step_end() {
  if (position_ == 0) return true;  // a step without uses: nothing to record or compare
  bool complete = true;
  if (following_) {
    if (position_ != trace_.size()) {  // ended early: the next step records afresh
      following_ = false;
      trace_.clear();
      ++departures_;
      complete = false;
    }
  } else {
    following_ = !trace_.empty();  // the recorded step is the trace
  }
  position_ = 0;
  return complete;
}

void Scheduler::set_live(size_t unit, bool live) {
  ZINF_CHECK(unit < elements_.size(), "unit {} of {}", unit, elements_.size());
  if (live_[unit] == live) return;
  live_[unit] = live;
  if (live) {
    live_elements_ += elements_[unit];
  } else {
    live_elements_ -= elements_[unit];
  }
}

std::vector<size_t> Scheduler::window(uint64_t budget) const {
  std::vector<size_t> out;
  if (!following_ || budget == 0) return out;
  uint64_t total = 0;
  for (size_t i = position_; i < trace_.size() && total < budget; ++i) {
    size_t u = trace_[i];
    if (std::find(out.begin(), out.end(), u) != out.end()) continue;
    out.push_back(u);
    total += elements_[u];
  }
  return out;
}

std::vector<size_t> Scheduler::gathers_ahead() const {
  std::vector<size_t> out;
  uint64_t live = live_elements_;
  for (size_t u : window(options_.prefetch_elements)) {
    if (live_[u]) continue;
    if (live + elements_[u] > options_.max_live_elements) break;  // in order: never skip ahead
    live += elements_[u];
    out.push_back(u);
  }
  return out;
}

std::vector<size_t> Scheduler::reads_ahead() const {
  std::vector<size_t> out;
  const uint64_t budget = options_.prefetch_elements * options_.read_ahead_factor;
  uint64_t live = live_elements_;
  for (size_t u : window(budget)) {
    if (live_[u]) continue;
    if (options_.reads_in_live_room) {
      if (live + elements_[u] > options_.max_live_elements) break;  // in order, as the gathers
      live += elements_[u];
    }
    out.push_back(u);
  }
  return out;
}

std::optional<size_t> Scheduler::next_use(size_t unit) const {
  if (!following_) return std::nullopt;
  for (size_t i = position_; i < trace_.size(); ++i) {
    if (trace_[i] == unit) return i;
  }
  return std::nullopt;
}

bool Scheduler::keep(size_t unit) const {
  std::optional<size_t> next = next_use(unit);
  if (!next || options_.max_reuse_distance == 0) return false;
  // The units used in between are gathered one after another while this one stays live: the
  // largest of those not live already must fit beside what is live now.
  uint64_t distance = 0, largest_between = 0;
  for (size_t i = position_; i < *next; ++i) {
    const size_t u = trace_[i];
    distance += elements_[u];
    if (!live_[u]) largest_between = std::max(largest_between, elements_[u]);
  }
  return distance <= options_.max_reuse_distance &&
         live_elements_ + largest_between <= options_.max_live_elements;
}

}  // namespace zinf::sched
