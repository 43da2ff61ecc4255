// The update walk behind step() (UpdatePolicy::behind): once the norm is known, step() hands the
// walk to the optimizer worker and returns. The walk goes in the order the next forward pass uses
// the units, and that pass's gather of a unit waits for the unit's own update (wait_unit). A
// failure leaves the step incomplete, as a failed classic update does: the next step() finishes
// it (finish) with the step's own hyperparameters.
//
// `pending` and `failed` belong to the thread that calls step(); the rest is shared with the
// worker under the walk's mutex.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "engine_state.h"
#include "norm_sums.h"
#include "optimizer_worker.h"
#include "piece_updater.h"
#include "walk_plan.h"

namespace zinf::engine_detail {

class BehindWalk {
 public:
  BehindWalk(EngineState& e, const WalkPlan& plan, PieceUpdater& updater, NormSums& sums)
      : e_(e), plan_(plan), updater_(updater), sums_(sums) {}

  // Starts the walk over every piece not yet updated, with the optimizer's hyperparameters as
  // they are now (set_lr() may change them while it runs).
  void start(const kernels::AdamStepArgs& args);
  // Started and not waited for yet.
  bool pending() const { return pending_; }
  // Waited for, and it failed: finish() owes the rest.
  bool failed() const { return failed_; }
  // Whether unit u's update is done (or no walk is pending): no waiting.
  bool unit_ready(size_t u);
  // Waits until unit u's pieces are updated; the walk's failure when it stopped before them.
  Status wait_unit(size_t u);
  // Waits for the whole walk and records its end (EngineState::record_update_end).
  Status wait();
  // The walk's first write-back failure, once (the data stays valid in memory).
  Status take_writeback();
  // Finishes a walk that failed, on the calling thread.
  Status finish(Status& writeback);

 private:
  // What the walk keeps for the next forward pass and the next walk.
  Keep keep_for_next_pass() const;
  void run(const std::vector<std::vector<size_t>>& todo, const kernels::AdamStepArgs& args,
           const kernels::AdamConfig& adam, const Keep& keep);

  EngineState& e_;
  const WalkPlan& plan_;
  PieceUpdater& updater_;
  NormSums& sums_;
  bool pending_ = false;
  bool failed_ = false;
  kernels::AdamStepArgs args_;
  kernels::AdamConfig adam_;
  // Shared with the worker.
  std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;
  std::vector<size_t> left_;  // per unit, its pieces in the walk not updated yet
  Status status_, writeback_;
  StoreStats end_stats_;  // the store's counters when the walk and its write-backs ended
  std::chrono::steady_clock::time_point end_at_;
  // Last: destroyed first, so its thread has ended before the state it works on goes.
  std::unique_ptr<OptimizerWorker> worker_;
};

}  // namespace zinf::engine_detail
