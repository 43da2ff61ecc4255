#include "behind_walk.h"

namespace zinf::engine_detail {

Keep BehindWalk::keep_for_next_pass() const {
  // The parameters are kept for the next forward pass (at that step's ticks: Gatherer's, once
  // this step is committed) when the step followed the trace (its uses are then known) and the
  // host budget has room beyond every accumulator (it reads groups ahead during the backward
  // pass). Without that room the walk needs it for its own reads: kept copies make a walk of the
  // 2 B shape about twice as slow, and the pass finds most shards still there all the same, since
  // it follows the walk closely. Shards left on the device between passes are kept whatever the
  // room: the pass's gather makes the host copy clean (the device's is as new), so it gives way
  // without being written.
  Keep keep;
  if ((plan_.room().groups_read_during_backward > 0 || e_.updates.params_stay_on_device) &&
      e_.sched->following() && plan_.knows_first_uses()) {
    const uint64_t trace = e_.sched->trace().size();
    keep = {.params = true,
            .tick = static_cast<uint64_t>(e_.steps + 1) * trace,
            .state_ranks = plan_.state_ranks_that_fit(),
            .state_tick = static_cast<uint64_t>(e_.steps + 2) * trace};
    keep.write_behind_from = plan_.write_behind_from(keep.state_ranks);
  }
  return keep;
}

void BehindWalk::start(const kernels::AdamStepArgs& args) {
  if (!worker_) worker_ = std::make_unique<OptimizerWorker>();
  const Keep keep = keep_for_next_pass();
  auto todo = plan_.pieces([&](size_t pi) { return !updater_.updated(pi); });
  std::vector<size_t> left(e_.unit_states.size(), 0);
  for (const auto& group : todo) {
    for (size_t pi : group) ++left[e_.pieces[pi].unit];
  }
  {
    std::lock_guard lk(mu_);
    running_ = true;
    left_ = std::move(left);
    status_ = Status();
    writeback_ = Status();
  }
  pending_ = true;
  failed_ = false;
  args_ = args;
  adam_ = e_.s.adam;
  worker_->submit([this, todo = std::move(todo), args, adam = e_.s.adam, keep]() -> Status {
    run(todo, args, adam, keep);
    return Status::ok();  // reported through wait_unit() and wait()
  });
}

void BehindWalk::run(const std::vector<std::vector<size_t>>& todo,
                     const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam,
                     const Keep& keep) {
  Status writeback;
  // A unit done is as after a committed step: its accumulators start again from zero and its
  // recorded sums are spent. The next pass's uses of the unit wait for this (wait_unit).
  Status st = updater_.walk(
      todo, args, adam, writeback,
      [this](size_t pi) {
        const size_t u = e_.pieces[pi].unit;
        std::lock_guard lk(mu_);
        if (--left_[u] > 0) return;
        e_.unit_states[u].acc_zero = true;
        for (size_t q : e_.unit_states[u].pieces) sums_.forget(q);
        cv_.notify_all();
      },
      keep);
  Status wb = e_.finish_evictions();
  if (writeback.is_ok()) writeback = std::move(wb);
  {
    std::lock_guard lk(mu_);
    end_stats_ = e_.store->stats();
    end_at_ = std::chrono::steady_clock::now();
    running_ = false;
    status_ = std::move(st);
    writeback_ = std::move(writeback);
    // Under the lock: a waiter that sees the walk ended may destroy the engine at once.
    cv_.notify_all();
  }
}

bool BehindWalk::unit_ready(size_t u) {
  if (!pending_) return true;
  std::lock_guard lk(mu_);
  return left_[u] == 0;
}

Status BehindWalk::wait_unit(size_t u) {
  if (!pending_) return Status::ok();
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return left_[u] == 0 || !running_; });
  if (left_[u] == 0) return Status::ok();
  return status_.is_ok()
             ? make_error(ErrorCode::kInternal,
                          "unit {}: the update walk ended without updating it", e_.units[u].name)
             : status_;
}

Status BehindWalk::wait() {
  if (!pending_) return Status::ok();
  Status st;
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !running_; });
    st = status_;
    e_.record_update_end(end_stats_, end_at_);
  }
  pending_ = false;
  if (!st.is_ok()) {
    failed_ = true;
    return st;
  }
  updater_.clear();
  return Status::ok();
}

Status BehindWalk::take_writeback() {
  std::lock_guard lk(mu_);
  return std::exchange(writeback_, Status());
}

Status BehindWalk::finish(Status& writeback) {
  ZINF_RETURN_IF_ERROR(updater_.walk(plan_.pieces([&](size_t pi) { return !updater_.updated(pi); }),
                                     args_, adam_, writeback));
  failed_ = false;
  return Status::ok();
}

}  // namespace zinf::engine_detail
