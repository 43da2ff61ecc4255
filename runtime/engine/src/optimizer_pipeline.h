// The optimizer pipeline: this rank's optimizer state, cut into pieces and packed into sub-groups
// (sched::plan_sub_groups), updated where it lives. It ties together parts with one job each:
//
//   WalkPlan      (walk_plan.h)      the order of the walk and the host room each mode gets;
//   NormSums      (norm_sums.h)      the global norm's partial sums;
//   PieceUpdater  (piece_updater.h)  Adam over a piece or a walk, and where its state goes after;
//   FusedUpdates  (fused_updates.h)  updates fused into the backward pass, on their worker;
//   BehindWalk    (behind_walk.h)    the walk behind step(), on its worker.
//
// Which of these run is the engine's UpdatePolicy (update_policy.h). Here: the plan's adoption,
// the classic walk step() runs (the reads of group g+1 in flight while g is updated with
// pipeline_read, g's write-back while g+1 is updated with pipeline_write), the reads of the
// first groups during the backward pass when they fit beside the accumulators, and the step's
// commit or skip.
#pragma once

#include <cstdint>

#include "behind_walk.h"
#include "engine_state.h"
#include "fused_updates.h"
#include "loss_scaler.h"
#include "norm_sums.h"
#include "piece_updater.h"
#include "walk_plan.h"
#include "zinf/sched/sub_groups.h"

namespace zinf::engine_detail {

class OptimizerPipeline {
 public:
  OptimizerPipeline(EngineState& e, const LossScaler& scaler);

  // The sub-group size in elements: sub_group_size, and with the optimizer offloaded at most a
  // third of what the host budget holds beside the staging buffers and two parameter tensors
  // (three groups are in flight: one read, one updated, one written back).
  uint64_t sub_group_limit() const;
  // Adopts the plan (pieces already in e.pieces, in plan order) under the engine's UpdatePolicy.
  // `accumulator_bytes`: the offloaded accumulators the backward pass fills.
  void set_plan(const sched::SubGroupPlan& plan, uint64_t accumulator_bytes);
  size_t sub_groups() const { return plan_.groups().size(); }

  // Gradients are averaged over ranks by the reduction; here over micro-steps and the loss scale.
  float combined_scale() const;
  // A piece's gradient is final: its norm sums are taken now (NormSums::record).
  Status record_sums(size_t pi, const TensorHandle& acc, uint64_t acc_base, Stream& stream) {
    return sums_.record(pi, acc, acc_base, stream, combined_scale());
  }
  // The unit's last reduction of the step completed: start its update (fused) or read the next
  // groups' state ahead.
  void on_grads_final(size_t u);

  // At the end of the backward pass: orders the walk by when each group's gradients become
  // final in the recorded trace (behind step(): by the next pass's first uses).
  void plan_walk();
  // Writes the zeros of accumulators that received no gradient this step (before they are read).
  Status zero_untouched_accumulators();
  // Updates every piece not yet updated in this step; `writeback` receives the first write-back
  // failure (the data stays valid in memory: the step goes on).
  Status update(const kernels::AdamStepArgs& args, Status& writeback);
  // Hands the walk to the worker (UpdatePolicy::behind), after the writes the last one left.
  void start_behind(const kernels::AdamStepArgs& args);

  // The step is committed on every rank: the next starts from zero gradients, nothing updated.
  // (With the walk behind still running, what it has not done yet is left to it.)
  void commit();
  // After commit() and the step's write-backs: fused, starts the writes the step's last updates
  // left and the reads of the next pass's first updates.
  void after_commit();
  // The step is skipped (a non-finite norm): its gradients are dropped.
  void discard();

  // The tick of unit u's update in the next walk behind step(), from the pass of the step being
  // made (about when the next forward pass first uses u).
  uint64_t next_walk_tick(size_t u) const;

  NormSums& sums() { return sums_; }
  PieceUpdater& updater() { return updater_; }
  FusedUpdates& fused() { return fused_; }
  BehindWalk& behind() { return behind_; }
  const BehindWalk& behind() const { return behind_; }

 private:
  // One ordered list on one mover, in walk order, for every group whose gradients are final so
  // far (behind step(): from the first) up to the number that fits.
  void read_ahead();
  // Starts writing back the state the last walk left dirty for it, the walk's last groups first
  // (the host budget drops the copies needed last first); they stay in memory, clean, until the
  // budget needs their room. Behind step() at the next backward pass's first final gradient;
  // fused, once step() has committed. A failure is reported by the next step().
  void write_behind();
  Status zero(const TensorHandle& h);

  EngineState& e_;
  const LossScaler& scaler_;
  WalkPlan plan_;
  NormSums sums_;
  PieceUpdater updater_;
  FusedUpdates fused_;
  BehindWalk behind_;
  size_t walk_prefetched_ = 0;  // groups of the walk whose state was read during backward
};

}  // namespace zinf::engine_detail
