// The optimizer pipeline: this rank's optimizer state, cut into pieces and packed into sub-groups
// (sched::plan_sub_groups), updated where it lives — device operations for state on the device,
// CPU Adam for state offloaded to host memory or NVMe (ZeRO-Offload).
//
//  - step() walks the groups in the order their gradients become final in the recorded trace
//    (the backward order): with pipeline_read the reads of group g+1 are in flight while g is
//    updated, with pipeline_write g's write-back while g+1 is updated; and the first groups are
//    read during the backward pass when they fit beside the accumulators.
//  - overlap_optimizer (when nothing needs every gradient first: no clipping, no overflow check):
//    a unit's update runs on a worker thread as soon as its gradients are final.
//  - update_behind (one rank, stage 3, the optimizer offloaded, no early updates): step() hands
//    the walk to the worker once the norm is known and returns; the walk goes in the order the
//    next forward pass uses the units (the backward pass reads its first groups ahead), and that
//    pass's gather of a unit waits for the unit's own update (wait_unit). A failure there leaves
//    the step incomplete, as a failed update() does: the next step() finishes it (finish_behind).
//  - A piece is updated once per step: `updated` remembers what is done, so a step() that failed
//    half-way (on this rank or another) is finished by the next step() without repeating work;
//    commit() clears it when every rank has agreed.
//  - The norm: partial_sum_squares() adds fixed 1024-element block sums left to right in unit
//    order, so the result does not depend on how the state is cut.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "engine_state.h"
#include "loss_scaler.h"
#include "zinf/sched/sub_groups.h"

namespace zinf::engine_detail {

class OptimizerWorker;

// What a walk keeps in memory after an update (update_behind). With `params`, a unit's parameters,
// once its pieces are done, stay for the next forward pass, whose use comes at `tick` + the unit's
// first use in the trace; otherwise they are written back and dropped. The optimizer state (m, v,
// a mixed master) of the pieces in the walk's first `state_ranks` groups stays too, dirty, for
// the next walk, at `state_tick` (that walk's, as record_sums() sets its accumulators') + the
// group's rank: it is neither written now nor read back (by the next backward pass's read-ahead,
// or by the walk) in between. The state of the groups from rank `write_behind_from` on (the walk's
// last, past the kept ones) stays dirty too, at the same ticks, and is written back during the
// next backward pass (write_behind()), when the disk is otherwise idle, rather than during the
// forward pass the walk runs under; a copy still there at the next walk is not read again.
// Fused into the backward pass (start_early_update), `tick` is the next use of the unit's
// refreshed device copy, and the groups from `write_behind_from` on are written once step() has
// committed (after_commit()), under the next forward pass.
struct Keep {
  bool params = false;
  uint64_t tick = 0;
  size_t state_ranks = 0;
  uint64_t state_tick = 0;
  size_t write_behind_from = SIZE_MAX;
};

class OptimizerPipeline {
 public:
  OptimizerPipeline(EngineState& e, const LossScaler& scaler);
  ~OptimizerPipeline();

  // The sub-group size in elements: sub_group_size, and with the optimizer offloaded at most a
  // third of what the host budget holds beside the staging buffers and two parameter tensors
  // (three groups are in flight: one read, one updated, one written back).
  uint64_t sub_group_limit() const;
  // Adopts the plan (pieces already in e.pieces, in plan order). `accumulator_bytes`: the
  // offloaded accumulators the backward pass fills (for the read-during-backward fit).
  void set_plan(const sched::SubGroupPlan& plan, uint64_t accumulator_bytes);

  // Gradients are averaged over ranks by the reduction; here over micro-steps and the loss scale.
  float combined_scale() const;
  // Whether a unit's update may start during the backward pass (overlap_optimizer, and nothing
  // needs every gradient first).
  bool updates_early() const;
  // The unit's last reduction of the step completed: start its update (overlap_optimizer) or
  // read the next groups' state ahead.
  void on_grads_final(size_t u);
  // Waits for the updates started early; the first failure. How many units were started.
  Status wait_early();
  size_t take_units_updated_early();
  // After wait_early(): the unit whose non-finite gradient the step's first fused update met,
  // with one rank, before anything was updated (the step is then skipped, as without
  // overlap_optimizer: nothing of it reached the state), or nullopt. Cleared for the next step.
  std::optional<size_t> take_nonfinite_before_any_update();
  // Whether an update of the step being made has been handed to the worker (its hyperparameters
  // are then fixed until step()).
  bool early_updates_started() const { return updated_early_ > 0; }

  // Orders the walk by when each group's gradients become final in the recorded trace.
  void plan_walk();
  // Writes the zeros of accumulators that received no gradient this step (before they are read).
  Status zero_untouched_accumulators();
  Result<double> partial_sum_squares(int range_rank, float scale_factor);
  // A piece's gradient is final (its unit's last reduction of the step was just added, and `acc`
  // holds it, its element 0 at flat index `acc_base`): its block sums of squares are taken now,
  // while it is in memory, for partial_sum_squares, which then need not read it back (from NVMe,
  // when the host budget could not keep it). Any later addition to the piece (a use the trace
  // did not predict) forgets them: forget_sums().
  Status record_sums(size_t pi, const TensorHandle& acc, uint64_t acc_base, Stream& stream);
  void forget_sums(size_t pi) {
    if (pi < sums_.size()) sums_[pi].valid = false;
  }
  // Updates every piece not yet updated in this step; `writeback` receives the first write-back
  // failure (the data stays valid in memory: the step goes on).
  Status update(const kernels::AdamStepArgs& args, Status& writeback);

  // Whether step() leaves the update walk to run behind it (update_behind and its conditions).
  bool updates_behind() const;
  // Behind step(), with room on the device for every unit (EngineState::device_holds_all_params):
  // a unit's device copy stays after the pass's last use until the next walk takes it back to
  // the host. The host copy, once the pass has the same bytes on the device, is clean: the store
  // drops it first when the host budget needs room, room the walk's kept state counts on.
  // Fused into the backward pass (updates_early), likewise: the update refreshes the device copy
  // from the host's (refresh_device_copy), which then goes unwritten.
  bool params_stay_on_device() const;
  // The tick of unit u's update in the next walk behind step(), from the pass of the step being
  // made (about when the next forward pass first uses u).
  uint64_t next_walk_tick(size_t u) const;
  // Starts the walk over every piece not yet updated on the worker, with the optimizer's
  // hyperparameters as they are now (set_lr() may change them while it runs).
  void start_behind(const kernels::AdamStepArgs& args);
  // Whether a walk started by start_behind() has not been waited for by wait_behind() yet.
  bool behind_pending() const { return behind_.pending; }
  // Whether unit u's update in the walk behind is done (or no walk is pending): no waiting.
  bool unit_ready(size_t u);
  // Waits until unit u's pieces are updated; the walk's failure when it stopped before them.
  Status wait_unit(size_t u);
  // Waits for the whole walk and records its end (EngineState::record_update_end). Its failure
  // leaves the step incomplete (behind_failed()) until finish_behind() completes it.
  Status wait_behind();
  // The walk's first write-back failure, once (the data stays valid in memory).
  Status take_behind_writeback() {
    std::lock_guard lk(behind_.mu);
    return std::exchange(behind_.writeback, Status());
  }
  bool behind_failed() const { return behind_.failed; }
  // Finishes a walk behind that failed, on the calling thread, with the step's own
  // hyperparameters.
  Status finish_behind(Status& writeback);

  // The step is committed on every rank: the next starts from zero gradients, nothing updated.
  // (With the walk behind still running, what it has not done yet is left to it.)
  void commit();
  // After commit() and the step's write-backs: fused into the backward pass, starts the writes
  // the step's last updates left (write_behind()) and the reads of the next pass's first updates.
  void after_commit();
  // The step is skipped (fp16 overflow): its gradients are dropped.
  void discard();
  size_t sub_groups() const { return groups_.size(); }

 private:
  Status update_piece(size_t pi, const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam,
                      const Keep& keep = {});
  // The pieces not updated yet, by group, in walk order.
  std::vector<std::vector<size_t>> pieces_to_update() const;
  // Updates `todo` group by group (see update()); `done(pi)` after each piece.
  Status walk(const std::vector<std::vector<size_t>>& todo, const kernels::AdamStepArgs& args,
              const kernels::AdamConfig& adam, Status& writeback,
              const std::function<void(size_t)>& done = {}, const Keep& keep = {});
  std::vector<size_t> first_use_;  // per unit, its first use in the recorded trace (plan_walk)
  void prefetch_piece(size_t pi, PrefetchRoom room = PrefetchRoom::kAny);
  // prefetch_piece() without the parameters and the accumulator: the piece's m, v (and master).
  void prefetch_state(size_t pi, PrefetchRoom room);
  // After unit u's update fused into the backward pass: its device copy made current again from
  // the host's, for the next forward pass (its use at tick `next_use`, when known: not 0). False
  // when the device had no room (nothing changed).
  bool refresh_device_copy(size_t u, uint64_t next_use);
  // The copies update_piece() acquires for piece `pi`, in its order.
  void append_reads(size_t pi, std::vector<std::pair<TensorId, Tier>>& reads,
                    bool with_params = true);
  void read_ahead();
  // How many of the walk's first groups have their optimizer state kept for the next walk: those
  // whose state fits, in walk order, in the host room left beside the kept parameters (set_plan).
  size_t state_ranks_that_fit() const;
  // The first rank whose state the walk leaves for write_behind(): the walk's last groups past
  // the first `state_ranks`, as many as fit in the host room once every accumulator is spent
  // (write_behind_room_).
  size_t write_behind_from(size_t state_ranks) const;
  // Starts writing back (on the store's movers) the state the last walk left dirty for it, the
  // walk's last groups first (the host budget drops the copies needed last first); they stay in
  // memory, clean, until the budget needs their room. Behind step() at the next backward pass's
  // first final gradient; fused into the backward pass, once step() has committed (the writes
  // then run under the next forward pass: after_commit()). A failure is reported by the next
  // step().
  void write_behind();
  void start_early_update(size_t u);
  Status zero(const TensorHandle& h);

  EngineState& e_;
  const LossScaler& scaler_;
  std::vector<std::vector<size_t>> groups_;  // sub-groups of pieces, in declaration order
  std::vector<size_t> walk_;                 // the order step() walks the groups in
  std::vector<size_t> walk_rank_;            // per piece, its group's place in walk_
  std::vector<uint64_t> group_state_bytes_;  // per group, the host bytes of m, v (and master)
  uint64_t largest_state_ = 0;               // the largest of those
  uint64_t state_room_ = 0;  // host room for state kept across a step (see set_plan())
  // Host room, once the walk has spent every accumulator, for the state kept across a step and
  // the state left dirty until the next backward pass (see set_plan()).
  uint64_t write_behind_room_ = 0;
  // The state the walk behind step() (or the updates fused into the backward pass) left for
  // write_behind(), in walk order. Filled by the worker, emptied by the thread that runs the
  // passes.
  std::mutex write_behind_mu_;
  std::vector<TensorId> write_behind_;
  void rank_walk();
  size_t walk_prefetched_ = 0;  // groups of walk_ whose state was read ahead during backward
  // How many groups' state is read during the backward pass: as many as fit beside the
  // accumulators the backward pass fills (more, and the host budget would evict the clean state
  // just read, which would then be read twice); 0 without pipeline_read.
  size_t groups_read_during_backward_ = 0;
  // Pieces whose update of the step being made is done. The worker marks the pieces it updates;
  // nothing else touches those entries until wait_early().
  std::vector<uint8_t> updated_;
  // Per piece, the block sums of squares of its final gradient in this step (record_sums), and
  // the scale factor they were taken with.
  struct Sums {
    bool valid = false;
    float factor = 0;
    std::vector<double> blocks;
  };
  std::vector<Sums> sums_;
  std::unique_ptr<OptimizerWorker> worker_;  // overlap_optimizer, update_behind
  size_t updated_early_ = 0;                 // units handed to the worker in this step
  // Fused into the backward pass, in the step being made: pieces updated so far, and the unit
  // whose non-finite gradient the first update met (take_nonfinite_before_any_update()). Written
  // by the worker, read once wait_early() has returned.
  size_t pieces_updated_early_ = 0;
  std::optional<size_t> nonfinite_before_any_update_;
  // The walk behind step(). `pending` and `failed` belong to the calling thread; the rest is
  // shared with the worker under `mu`.
  struct Behind {
    bool pending = false;  // started, not waited for yet
    bool failed = false;   // waited for, and it failed: finish_behind() owes the rest
    kernels::AdamStepArgs args;
    kernels::AdamConfig adam;
    std::mutex mu;
    std::condition_variable cv;
    bool running = false;
    std::vector<size_t> left;  // per unit, its pieces in the walk not updated yet
    Status status, writeback;
    StoreStats end_stats;  // the store's counters when the walk and its write-backs ended
    std::chrono::steady_clock::time_point end_at;
  };
  Behind behind_;
};

}  // namespace zinf::engine_detail
