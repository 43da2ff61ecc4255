#include "optimizer_pipeline.h"

#include <algorithm>
#include <cstring>

#include "update_policy.h"
#include "zinf/core/log.h"
#include "zinf/core/state_bytes.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::engine_detail {

OptimizerPipeline::OptimizerPipeline(EngineState& e, const LossScaler& scaler)
    : e_(e),
      scaler_(scaler),
      sums_(e, plan_),
      updater_(e, plan_),
      fused_(e, plan_, updater_),
      behind_(e, plan_, updater_, sums_) {
  if (!e_.s.overlap_optimizer) return;
  if (!UpdatePolicy::fusable(e_.s)) {
    log::warn_once("engine:overlap-optimizer",
                   "overlap_optimizer has no effect with gradient clipping or fp16: the "
                   "update needs every gradient (the global norm, the overflow check) first");
    return;
  }
  fused_.open();
  log::info(
      "overlap_optimizer: updates start before the global gradient norm is known, so a "
      "non-finite gradient met after the step's first update cannot skip the step: it stops "
      "the run instead (with one rank, one met by the first update skips the step)");
}

uint64_t OptimizerPipeline::sub_group_limit() const {
  const uint64_t limit = e_.s.sub_group_elements;
  if (limit == 0 || e_.s.optimizer_home == Tier::kDevice) return limit;
  // Per element of a group: fp32 master (mixed), m, v and gradient accumulator. A unit's
  // parameter tensor is acquired whole for its pieces' updates: the two it holds (the one being
  // updated, the next read ahead: StateSizes::cpu_update_bytes) and the staging buffers come off
  // the budget first.
  const uint64_t bytes_per_element =
      optimizer_state_bytes_per_element(e_.s.dtype, Accumulator::kIncluded);
  const uint64_t reserved = e_.staging_total + e_.sizes.cpu_update_bytes;
  const uint64_t fit =
      (e_.s.host_mem - std::min(e_.s.host_mem, reserved)) / (3 * bytes_per_element);
  return std::min(limit, std::max(fit / kernels::kSumSquaresBlockElems, uint64_t{1}) *
                             kernels::kSumSquaresBlockElems);
}

void OptimizerPipeline::set_plan(const sched::SubGroupPlan& plan, uint64_t accumulator_bytes) {
  // Bytes a group's read-ahead brings into the host budget: m, v and the fp32 master (mixed) of
  // its pieces unless they live there, and the whole parameter tensor of each of its units
  // unless homed there (an update acquires the unit's tensor) or left on the device between
  // passes (the walk takes it from there: read_ahead() does not ask for it).
  const uint64_t state_per_element =
      e_.s.optimizer_home == Tier::kHost
          ? 0
          : optimizer_state_bytes_per_element(e_.s.dtype, Accumulator::kExcluded);
  const bool params_read = e_.policy.sharded_params && e_.s.param_home != Tier::kHost &&
                           !e_.updates.params_stay_on_device;
  HostRoomInputs in{
      .host_mem = e_.s.host_mem,
      .staging_bytes = e_.staging_total,
      .host_home_bytes = e_.sizes.host_home_bytes,
      .nvme_accumulator_bytes = e_.s.optimizer_home == Tier::kHost ? 0 : accumulator_bytes,
      .cpu_update_bytes = e_.sizes.cpu_update_bytes,
      .largest_unit_elements = e_.sizes.largest_unit_elements,
      .pipeline_read = e_.s.pipeline_read,
      .fused = e_.updates.fused,
      .params_stay_on_device = e_.updates.params_stay_on_device};
  for (const std::vector<size_t>& group : plan.groups) {
    uint64_t state = 0, params = 0;
    size_t last_unit = SIZE_MAX;
    for (size_t pi : group) {
      const sched::Piece& piece = plan.pieces[pi];
      state += piece.range.size() * state_per_element;
      if (params_read && piece.unit != last_unit) {  // (a group's pieces are consecutive)
        params +=
            e_.policy.param_elements(e_.unit_states[piece.unit].layout) * dtype_size(e_.s.dtype);
      }
      last_unit = piece.unit;
    }
    in.group_state_bytes.push_back(state);
    in.group_read_bytes.push_back(state + params);
    in.all_param_bytes += params;
  }
  std::vector<size_t> piece_units;
  for (const sched::Piece& piece : plan.pieces) piece_units.push_back(piece.unit);
  const HostRoom room = plan_host_room(in);
  plan_ = WalkPlan(plan.groups, std::move(piece_units), e_.unit_states.size(), room,
                   std::move(in.group_state_bytes));
  updater_.reset(plan.pieces.size());
  sums_.reset(plan.pieces.size());
}

float OptimizerPipeline::combined_scale() const {
  return static_cast<float>(
      1.0 / (static_cast<double>(e_.s.gradient_accumulation_steps) * scaler_.scale()));
}

void OptimizerPipeline::on_grads_final(size_t u) {
  UnitState& st = e_.unit_states[u];
  st.grads_final = true;
  if (!e_.updates.fused) write_behind();  // (fused: after_commit())
  if (st.final_issued) {
    fused_.start(u, {.step = e_.steps + 1, .grad_scale = combined_scale()});
  } else if (plan_.room().groups_read_during_backward > 0) {
    read_ahead();
  }
}

void OptimizerPipeline::plan_walk() {
  walk_prefetched_ = 0;
  for (UnitState& st : e_.unit_states) st.grads_final = false;
  // Not following: the order of the last recorded trace stays.
  if (e_.sched->following()) plan_.order(e_.sched->trace(), e_.updates.behind);
}

Status OptimizerPipeline::zero(const TensorHandle& h) {
  if (h.tier() == Tier::kDevice) {
    e_.device->fill({.data = h.data(), .dtype = DType::kF32, .numel = h.bytes() / 4}, 0.0f,
                    *e_.stream);
    return sync(*e_.stream);
  }
  std::memset(h.data(), 0, h.bytes());
  return Status::ok();
}

Status OptimizerPipeline::zero_untouched_accumulators() {
  for (UnitState& st : e_.unit_states) {
    if (!st.acc_zero) continue;
    for (size_t pi : st.pieces) {
      const PieceState& p = e_.pieces[pi];
      if (!p.owns_acc && pi != st.pieces.front()) continue;  // a shared one: once
      ZINF_ASSIGN_OR_RETURN(
          TensorHandle acc,
          e_.store->acquire(p.acc, EngineState::compute_tier(st), Access::kOverwrite));
      ZINF_RETURN_IF_ERROR(zero(acc));
      acc.mark_dirty();
    }
    for (size_t pi : st.pieces) sums_.forget(pi);  // sums from before a checkpoint load
    st.acc_zero = false;
  }
  return Status::ok();
}

Status OptimizerPipeline::update(const kernels::AdamStepArgs& args, Status& writeback) {
  return updater_.walk(plan_.pieces([&](size_t pi) { return !updater_.updated(pi); }), args,
                       e_.s.adam, writeback);
}

void OptimizerPipeline::start_behind(const kernels::AdamStepArgs& args) {
  write_behind();  // what the last walk left, when no backward pass came since
  behind_.start(args);
}

uint64_t OptimizerPipeline::next_walk_tick(size_t u) const {
  return plan_.next_pass_tick(u, e_.steps, e_.sched->trace().size());
}

void OptimizerPipeline::write_behind() {
  const std::vector<TensorId> left = updater_.take_write_behind();
  // Filled in walk order: the last groups first.
  for (auto it = left.rbegin(); it != left.rend(); ++it) e_.write_back_offloaded(*it, Tier::kHost);
}

void OptimizerPipeline::commit() {
  // Behind step(), the walk clears each unit as it updates it, and BehindWalk::wait() the rest.
  if (behind_.pending()) return;
  updater_.clear();
  discard();
}

void OptimizerPipeline::after_commit() {
  if (!e_.updates.fused) return;
  write_behind();
  fused_.read_next_pass_first();
}

// After a step the accumulators are zero; the bytes are written only when needed.
void OptimizerPipeline::discard() {
  for (UnitState& st : e_.unit_states) st.acc_zero = true;
  sums_.forget_all();
}

// The other mover stays free for the reads the backward pass waits for, and a list that stopped
// for want of room is taken up again by the next call, once the backward pass has freed some (a
// newer list supersedes the older).
void OptimizerPipeline::read_ahead() {
  auto final = [&](size_t r) {
    const std::vector<size_t>& group = plan_.group(r);
    return std::all_of(group.begin(), group.end(),
                       [&](size_t pi) { return e_.unit_states[e_.pieces[pi].unit].grads_final; });
  };
  const size_t limit = std::min(plan_.room().groups_read_during_backward, plan_.size());
  // Behind step() the walk goes in the forward order, whose first units' gradients are final
  // last: their state (which needs no gradient) is read from the backward pass's start.
  while (walk_prefetched_ < limit && (e_.updates.behind || final(walk_prefetched_))) {
    ++walk_prefetched_;
  }
  if (walk_prefetched_ == 0) return;
  // Parameters that stay on the device come back to the host at the walk: the pass is using them.
  const bool with_params = !e_.updates.params_stay_on_device;
  std::vector<std::pair<TensorId, Tier>> reads;
  for (size_t r = 0; r < walk_prefetched_; ++r) {
    for (size_t pi : plan_.group(r)) updater_.append_reads(pi, reads, with_params);
  }
  e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
}

}  // namespace zinf::engine_detail
