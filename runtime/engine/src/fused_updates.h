// Updates fused into the backward pass (UpdatePolicy::fused): a unit's update runs on the
// optimizer worker as soon as its gradients are final. The state of the step's last updates is
// written under the next forward pass (after the step commits), when the disk is otherwise idle;
// the next pass's first updates have their state read there too.
#pragma once

#include <memory>

#include "engine_state.h"
#include "optimizer_worker.h"
#include "piece_updater.h"
#include "walk_plan.h"

namespace zinf::engine_detail {

class FusedUpdates {
 public:
  FusedUpdates(EngineState& e, const WalkPlan& plan, PieceUpdater& updater)
      : e_(e), plan_(plan), updater_(updater) {}

  // The worker starts once the engine is built (UpdatePolicy::fused).
  void open() { worker_ = std::make_unique<OptimizerWorker>(); }
  // Hands unit u's update to the worker. A group holding pieces of u and of other units is then
  // updated partly here and partly by step(), which skips what was done.
  void start(size_t u, const kernels::AdamStepArgs& args);
  // Waits for the updates started; the first failure.
  Status wait() { return worker_ ? worker_->wait() : Status::ok(); }
  // How many units were handed to the worker since the last take (the step being made).
  size_t take_units_started() { return std::exchange(units_started_, 0); }
  // Whether an update of the step being made has been handed to the worker (its hyperparameters
  // are then fixed until step()).
  bool started() const { return units_started_ > 0; }
  // After the step commits: the reads of the next pass's first updates, under its forward pass
  // (which moves nothing else when the shards stay on the device), as far as two of the largest
  // groups (the room the pass's updates need anyway), clean copies only giving way.
  void read_next_pass_first();

 private:
  EngineState& e_;
  const WalkPlan& plan_;
  PieceUpdater& updater_;
  std::unique_ptr<OptimizerWorker> worker_;
  size_t units_started_ = 0;
};

}  // namespace zinf::engine_detail
