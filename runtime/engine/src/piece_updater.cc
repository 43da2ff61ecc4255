#include "piece_updater.h"

#include <algorithm>

#include "zinf/core/log.h"
#include "zinf/core/trace.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::engine_detail {

bool PieceUpdater::unit_done(size_t u) const {
  const std::vector<size_t>& pieces = e_.unit_states[u].pieces;
  return std::all_of(pieces.begin(), pieces.end(), [&](size_t q) { return updated_[q] != 0; });
}

Status PieceUpdater::update(size_t pi, const kernels::AdamStepArgs& args,
                            const kernels::AdamConfig& adam, const Keep& keep) {
  const PieceState& p = e_.pieces[pi];
  const UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  const bool fused = e_.updates.fused;
  if (fused && nonfinite_before_any_update_) {
    // The step is skipped (skip_or_stop): its gradient is dead, and nothing is updated.
    return e_.discard_offloaded(p.acc, st.opt_home, tier);
  }
  ZINF_ASSIGN_OR_RETURN(Held held, acquire(p, st, tier));
  if (fused) {
    ZINF_ASSIGN_OR_RETURN(const bool bad, has_nonfinite(p, tier, held.acc));
    if (bad) return skip_or_stop(p, st, tier, held);
  }
  ZINF_RETURN_IF_ERROR(run_adam(p, st, tier, held, args, adam));
  held.params.mark_dirty();
  if (e_.mixed) held.master.mark_dirty();
  held.m.mark_dirty();
  held.v.mark_dirty();
  for (TensorHandle* h : {&held.params, &held.master, &held.m, &held.v, &held.acc}) h->release();
  updated_[pi] = 1;
  if (fused) ++pieces_updated_early_;
  // What the unit's pieces share (its parameters, a full accumulator) goes once all of them are
  // done: the walk may visit a unit's pieces out of order.
  const bool all_done = unit_done(p.unit);
  if (tier != Tier::kDevice) {
    place_state(pi, p, st, tier, keep);
    if (p.owns_acc || all_done) ZINF_RETURN_IF_ERROR(spend_accumulator(p, st, tier));
  }
  if (e_.policy.sharded_params && all_done) place_params(p.unit, st, tier, keep);
  return Status::ok();
}

Result<PieceUpdater::Held> PieceUpdater::acquire(const PieceState& p, const UnitState& st,
                                                 Tier tier) {
  Held h;
  ZINF_ASSIGN_OR_RETURN(h.params, e_.store->acquire(st.params, tier));
  if (e_.mixed) {
    ZINF_ASSIGN_OR_RETURN(h.master, e_.store->acquire(p.master, tier));
  }
  ZINF_ASSIGN_OR_RETURN(h.m, e_.store->acquire(p.m, tier));
  ZINF_ASSIGN_OR_RETURN(h.v, e_.store->acquire(p.v, tier));
  ZINF_ASSIGN_OR_RETURN(h.acc, e_.store->acquire(p.acc, tier));
  return h;
}

Result<bool> PieceUpdater::has_nonfinite(const PieceState& p, Tier tier, const TensorHandle& acc) {
  const uint64_t n = p.end - p.begin;
  float* grads = static_cast<float*>(acc.data()) + (p.begin - p.acc_base);
  if (tier != Tier::kDevice) {
    return kernels::grad_has_nonfinite(grads, DType::kF32, n, e_.s.optimizer_threads);
  }
  bool bad = false;
  e_.device->scale({.data = grads, .dtype = DType::kF32, .numel = n}, 1.0f, &bad,
                   *e_.optimizer_stream);
  ZINF_RETURN_IF_ERROR(sync(*e_.optimizer_stream));
  return bad;
}

Status PieceUpdater::skip_or_stop(const PieceState& p, const UnitState& st, Tier tier, Held& held) {
  if (e_.world == 1 && pieces_updated_early_ == 0) {
    // Met by the step's first update (a non-finite loss makes the first gradient so): nothing
    // has reached the state yet, so the step is skipped as in the classic mode (step() sees
    // take_nonfinite_before_any_update()). With several ranks another rank may have updated its
    // first unit already: that case stops below.
    nonfinite_before_any_update_ = p.unit;
    held.acc.release();
    return e_.discard_offloaded(p.acc, st.opt_home, tier);
  }
  return make_error(ErrorCode::kNonFinite,
                    "unit {}: a non-finite gradient (inf or NaN) while units are updated "
                    "during the backward pass (overlap_optimizer): the units updated before "
                    "it in this step cannot be taken back, so the run stops here with this "
                    "unit not updated; resume from a checkpoint (without overlap_optimizer "
                    "such a step is skipped)",
                    e_.units[p.unit].name);
}

Status PieceUpdater::run_adam(const PieceState& p, const UnitState& st, Tier tier, const Held& held,
                              const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam) {
  trace::Span span(e_.track("cpu adam"), "adam " + e_.units[p.unit].name);
  const uint64_t wsize = dtype_size(e_.s.dtype);
  const bool mixed = e_.mixed;
  for (const zero::Segment& seg : zero::segments(st.layout, p.begin, p.end)) {
    kernels::AdamConfig cfg = adam;
    if (!seg.weight_decay) cfg.weight_decay = 0;
    const uint64_t si = seg.begin - p.begin, pidx = e_.param_index(st, seg.begin);
    kernels::AdamTensors t{
        .param = mixed ? static_cast<float*>(held.master.data()) + si
                       : static_cast<float*>(held.params.data()) + pidx,
        .m = static_cast<float*>(held.m.data()) + si,
        .v = static_cast<float*>(held.v.data()) + si,
        .grad = static_cast<const float*>(held.acc.data()) + (seg.begin - p.acc_base),
        .grad_dtype = DType::kF32,
        .param_copy = mixed ? static_cast<char*>(held.params.data()) + pidx * wsize : nullptr,
        .copy_dtype = e_.s.dtype,
        .n = seg.end - seg.begin};
    if (tier == Tier::kDevice) {
      e_.device->adam(cfg, args, t, *e_.optimizer_stream);
    } else {  // ZeRO-Offload: CPU Adam on host-resident state
      kernels::adam_step(cfg, args, t, e_.s.optimizer_threads);
    }
  }
  return tier == Tier::kDevice ? sync(*e_.optimizer_stream) : Status::ok();
}

void PieceUpdater::place_state(size_t pi, const PieceState& p, const UnitState& st, Tier tier,
                               const Keep& keep) {
  const size_t rank = plan_.rank_of(pi);
  if (rank < keep.state_ranks) {
    // The next walk needs this state first: it stays here, dirty, rather than being written now
    // and read back (written out only if the store needs its room, farthest next use first).
    for (TensorId id : {p.m, p.v, p.master}) {
      if (id != kNoTensor) e_.store->set_next_use(id, keep.state_tick + rank);
    }
  } else if (rank != SIZE_MAX && rank >= keep.write_behind_from) {
    // Written later (take_write_behind()), not under the pass the walk runs beside.
    std::lock_guard lk(write_behind_mu_);
    for (TensorId id : {p.m, p.v, p.master}) {
      if (id == kNoTensor) continue;
      e_.store->set_next_use(id, keep.state_tick + rank);
      write_behind_.push_back(id);
    }
  } else {
    e_.release_offloaded(p.m, st.opt_home, tier);
    e_.release_offloaded(p.v, st.opt_home, tier);
    if (e_.mixed) e_.release_offloaded(p.master, st.opt_home, tier);
  }
}

Status PieceUpdater::spend_accumulator(const PieceState& p, const UnitState& st, Tier tier) {
  // The next step overwrites the accumulator (acc_zero), so its copy here goes without being
  // written back. A copy the store is still moving is left to it; the eviction below then takes
  // it once free (a no-op after a discard).
  ZINF_RETURN_IF_ERROR(e_.discard_offloaded(p.acc, st.opt_home, tier));
  e_.release_offloaded(p.acc, st.opt_home, tier);
  e_.store->clear_next_use(p.acc);  // the walk position set when its sums were recorded is past
  return Status::ok();
}

void PieceUpdater::place_params(size_t u, const UnitState& st, Tier tier, const Keep& keep) {
  if (e_.updates.fused && e_.updates.params_stay_on_device && tier != Tier::kDevice &&
      refresh_device_copy(u, keep.tick)) {
    // The next forward pass uses the refreshed device copy; the host copy, now clean, goes
    // without being written.
    e_.release_offloaded(st.params, e_.s.param_home, tier);
  } else if (keep.params && tier != Tier::kDevice && plan_.has_first_use(u)) {
    // The next forward pass gathers them soon (behind step()): from here, not from NVMe. They
    // stay as they are, not written back: the store writes them out only if it needs their room
    // (a dirty copy goes after the clean ones), or once the pass's device copy is the only one
    // left and goes; a shard that stays in memory until the next walk updates it again never
    // reaches the disk in between.
    e_.store->set_next_use(st.params, keep.tick + plan_.first_use(u));
  } else {
    e_.release_offloaded(st.params, e_.s.param_home, tier);
  }
}

bool PieceUpdater::refresh_device_copy(size_t u, uint64_t next_use) {
  const TensorId params = e_.unit_states[u].params;
  auto device = e_.store->acquire(params, Tier::kDevice);
  if (!device.is_ok()) {  // an optimisation only: the shard then goes to NVMe
    log::debug("engine: {}'s device copy not refreshed after its update: {}", e_.units[u].name,
               device.status().to_string());
    return false;
  }
  device->release();
  if (next_use > 0) e_.store->set_next_use(params, next_use);
  return true;
}

Status PieceUpdater::walk(const std::vector<std::vector<size_t>>& todo,
                          const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam,
                          Status& writeback, const std::function<void(size_t)>& done,
                          const Keep& keep) {
  // The reads go into the room there is: clean copies only are evicted for them (the
  // accumulators still to be used stay, and nothing read ahead goes), and they stop at the first
  // that does not fit, so a later one never takes the room an earlier one needs. Asked again
  // before the next piece, once the pieces before it are written back and freed; what is still
  // missing when its piece comes is read on demand. When the walk ends (or fails) the last list
  // stops: whatever it still has to read is done with.
  struct StopReads {
    TieredTensorStore& store;
    ~StopReads() { store.prefetch_in_order({}, PrefetchRoom::kCleanOnly); }
  } stop_reads{*e_.store};
  for (size_t g = 0; g < todo.size(); ++g) {
    for (size_t k = 0; k < todo[g].size(); ++k) {
      if (e_.s.pipeline_read) {
        std::vector<std::pair<TensorId, Tier>> reads;
        for (size_t j = k; j < todo[g].size(); ++j) append_reads(todo[g][j], reads);
        if (g + 1 < todo.size()) {
          for (size_t pi : todo[g + 1]) append_reads(pi, reads);
        }
        e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
      }
      ZINF_RETURN_IF_ERROR(update(todo[g][k], args, adam, keep));
      if (done) done(todo[g][k]);
    }
    if (!e_.s.pipeline_write) {
      Status wb = e_.finish_evictions();
      if (writeback.is_ok()) writeback = std::move(wb);
    }
  }
  return Status::ok();
}

void PieceUpdater::prefetch_piece(size_t pi, PrefetchRoom room) {
  prefetch_state(pi, room);
  const PieceState& p = e_.pieces[pi];
  const UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  for (TensorId id : {st.params, p.acc}) {
    if (id != kNoTensor) e_.store->prefetch(id, tier, room);
  }
}

void PieceUpdater::prefetch_state(size_t pi, PrefetchRoom room) {
  const PieceState& p = e_.pieces[pi];
  const Tier tier = EngineState::compute_tier(e_.unit_states[p.unit]);
  for (TensorId id : {p.m, p.v, p.master}) {
    if (id != kNoTensor) e_.store->prefetch(id, tier, room);
  }
}

void PieceUpdater::append_reads(size_t pi, std::vector<std::pair<TensorId, Tier>>& reads,
                                bool with_params) const {
  const PieceState& p = e_.pieces[pi];
  const UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  // Zero with its unit's gradients still to come (behind step(), the walk's first groups are
  // read from the backward pass's start), the accumulator holds nothing the pass will not
  // overwrite (acc_zero): reading its home's old bytes would be a wasted read.
  const bool acc_dead = st.acc_zero && !st.grads_final;
  for (TensorId id :
       {with_params ? st.params : kNoTensor, p.master, p.m, p.v, acc_dead ? kNoTensor : p.acc}) {
    if (id != kNoTensor) reads.emplace_back(id, tier);  // as update() takes them
  }
}

std::vector<TensorId> PieceUpdater::take_write_behind() {
  std::vector<TensorId> left;
  std::lock_guard lk(write_behind_mu_);
  left.swap(write_behind_);
  return left;
}

std::optional<size_t> PieceUpdater::take_nonfinite_before_any_update() {
  pieces_updated_early_ = 0;
  return std::exchange(nonfinite_before_any_update_, std::nullopt);
}

}  // namespace zinf::engine_detail
