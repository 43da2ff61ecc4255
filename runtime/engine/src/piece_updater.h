// Adam over the optimizer's pieces where their state lives (device operations, or CPU Adam for
// state offloaded to host memory or NVMe), one piece at a time or as a walk over groups with the
// next reads in flight; and, after each update, where the piece's state and its unit's
// parameters go (kept for a next use, left for a later write-back, or written back and dropped).
//
// A piece is updated once per step: `updated` remembers what is done, so a step() that failed
// half-way is finished by the next one without repeating work; clear() starts the next step.
// The updates run on one thread at a time (the caller's, or the optimizer worker's).
#pragma once

#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include "engine_state.h"
#include "walk_plan.h"
#include "zinf/kernels/adam_math.h"

namespace zinf::engine_detail {

class PieceUpdater {
 public:
  PieceUpdater(EngineState& e, const WalkPlan& plan) : e_(e), plan_(plan) {}

  void reset(size_t pieces) { updated_.assign(pieces, 0); }
  bool updated(size_t pi) const { return updated_[pi] != 0; }
  void clear() { std::fill(updated_.begin(), updated_.end(), 0); }
  // Every piece of the unit is updated in this step.
  bool unit_done(size_t u) const;

  // Updates one piece with `args` and `adam`, placing what it used as `keep` says.
  Status update(size_t pi, const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam,
                const Keep& keep = {});
  // Updates `todo` group by group, in order: before each piece the reads of the rest of its
  // group and of the next group are asked for (pipeline_read); after each group the write-backs
  // are waited for unless pipeline_write (their first failure into `writeback`: the data stays
  // valid in memory). `done(pi)` after each piece.
  Status walk(const std::vector<std::vector<size_t>>& todo, const kernels::AdamStepArgs& args,
              const kernels::AdamConfig& adam, Status& writeback,
              const std::function<void(size_t)>& done = {}, const Keep& keep = {});

  // Starts bringing a piece's optimizer state (and its unit's parameters and accumulator) to
  // where its update runs; prefetch_state() the state alone.
  void prefetch_piece(size_t pi, PrefetchRoom room = PrefetchRoom::kAny);
  void prefetch_state(size_t pi, PrefetchRoom room);
  // The copies update() acquires for piece `pi`, in its order (an accumulator holding nothing
  // yet, zero with its unit's gradients still to come, is left out).
  void append_reads(size_t pi, std::vector<std::pair<TensorId, Tier>>& reads,
                    bool with_params = true) const;

  // The state the walk left dirty for a later write-back (Keep::write_behind_from), in walk
  // order; taken by the thread that runs the passes.
  std::vector<TensorId> take_write_behind();

  // Fused into the backward pass, the step being made: the unit whose non-finite gradient the
  // step's first update met with one rank, before anything was updated (the step is then
  // skipped: the updates after it do nothing), or nullopt. Taking it starts the next step.
  std::optional<size_t> take_nonfinite_before_any_update();

 private:
  // The piece's tensors where its update runs, acquired in this order.
  struct Held {
    TensorHandle params, master, m, v, acc;
  };
  Result<Held> acquire(const PieceState& p, const UnitState& st, Tier tier);
  // Fused: whether the piece's gradient holds an inf or NaN (before any global check).
  Result<bool> has_nonfinite(const PieceState& p, Tier tier, const TensorHandle& acc);
  // Fused, a non-finite gradient: skips the step when nothing was updated yet (one rank), else
  // fails: the units updated before it cannot be taken back.
  Status skip_or_stop(const PieceState& p, const UnitState& st, Tier tier, Held& held);
  Status run_adam(const PieceState& p, const UnitState& st, Tier tier, const Held& held,
                  const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam);
  // Offloaded state after its update: kept, left for write_behind, or written back and dropped.
  void place_state(size_t pi, const PieceState& p, const UnitState& st, Tier tier,
                   const Keep& keep);
  // The gradient is spent: its accumulator's copy goes unwritten.
  Status spend_accumulator(const PieceState& p, const UnitState& st, Tier tier);
  // A unit's parameters once all its pieces are updated (sharded parameters).
  void place_params(size_t u, const UnitState& st, Tier tier, const Keep& keep);
  // Fused, shards left on the device: the device copy made current again from the host's, for
  // the next forward pass (its use at tick `next_use`, when known: not 0). False when the device
  // had no room (nothing changed).
  bool refresh_device_copy(size_t u, uint64_t next_use);

  EngineState& e_;
  const WalkPlan& plan_;
  std::vector<uint8_t> updated_;  // per piece, in the step being made
  std::mutex write_behind_mu_;
  std::vector<TensorId> write_behind_;
  // Fused: pieces updated so far in the step being made, and the unit whose non-finite gradient
  // the first update met. Written by the worker, read once its jobs are waited for.
  size_t pieces_updated_early_ = 0;
  std::optional<size_t> nonfinite_before_any_update_;
};

}  // namespace zinf::engine_detail
