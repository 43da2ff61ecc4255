// Gathering: each use of a unit (Engine::gather) gets the unit's full parameters on the device.
//
//  - Full parameters (stages 0-2): the resident tensor, pinned for the scope.
//  - Sharded parameters (stage 3): the shards are all-gathered into a transient buffer, on demand
//    or ahead of the use along the recorded trace (sched::Scheduler), and the unit is kept gathered
//    while the trace says it is used again soon (or is persistent). Every decision depends on the
//    trace, the sizes and the device budget only (the ranks agree on the budget when it is built),
//    so every rank issues the same all-gathers in the same order. With one rank the shard is the
//    whole unit: a gather holds the shard's device copy (fetched through the tiers as before) and
//    copies nothing.
//  - After a committed step, with StagePolicy::share_updated_params (stages 1-2), every rank's
//    updated shard is all-gathered into every rank's full parameters.
// A unit whose all-gather is in flight owns its buffers until the gather completes: drop() and
// drop_all() wait for it.
#pragma once

#include "engine_state.h"

namespace zinf::engine_detail {

class OptimizerPipeline;

class Gatherer {
 public:
  // `optimizer`: with its update running behind step(), a unit is gathered (or read ahead) only
  // once its own update is done.
  Gatherer(EngineState& e, OptimizerPipeline& optimizer) : e_(e), optimizer_(optimizer) {}

  // Records a use of unit u in the trace (a departure re-records it); refuses a use the step
  // cannot serve (an unfinished step, a unit already updated under overlap_optimizer).
  Status on_use(size_t u);
  // The unit's full parameters on the device for a scope, opened on the unit (`resident` pins the
  // resident tensor when the parameters are not sharded): numel_padded elements of the working
  // dtype. The next units' reads and all-gathers are issued before this one's all-gather is
  // waited for.
  Result<TensorRef> begin_use(size_t u, TensorHandle& resident);
  // The scope on unit u ended: the last one lets its gathered parameters go unless the unit is
  // persistent or kept for a use soon.
  void end_use(size_t u);
  // Step end: nothing stays gathered (the parameters are about to change).
  void drop_all();
  // Stages 1-2 after a committed step: every rank's updated shard to every rank.
  Status share_updated_parameters();

 private:
  // Issues u's all-gather into a new buffer (with one rank: holds the shard's device copy): u
  // becomes live.
  Status start(size_t u);
  // Waits for u's all-gather (if in flight) and lets its shard go. `for_update`: u's update
  // follows soon on the host (its last use of the step, updates fused into backward): the shard
  // is first copied to the host from the device copy the gather used, so that the update does not
  // read it from NVMe again.
  Status finish(size_t u, bool for_update = false);
  void keep_for_update(size_t u);  // that copy to the host (best effort)
  // u is no longer live (with one rank, the shard's device copy goes as finish() lets it go,
  // or stays for the next update walk: UpdatePolicy::params_stay_on_device).
  void drop(size_t u);
  Status plan_ahead();  // the reads and all-gathers the trace says come next

  EngineState& e_;
  OptimizerPipeline& optimizer_;
};

}  // namespace zinf::engine_detail
