#include "gatherer.h"

#include "optimizer_pipeline.h"
#include "zinf/core/log.h"

namespace zinf::engine_detail {

Status Gatherer::on_use(size_t u) {
  if (!e_.fatal.is_ok()) return e_.fatal;
  if (e_.update_incomplete) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the last step() failed (its gradients are still pending and part of the "
                      "optimizer state may be updated); call step() again to finish it before "
                      "using unit {}",
                      e_.units[u].name);
  }
  if (e_.unit_states[u].final_issued) {
    return make_error(ErrorCode::kInvalidArgument,
                      "unit {} is used again after its optimizer update started in this step "
                      "(overlap_optimizer needs every step to use the units in the recorded "
                      "order)",
                      e_.units[u].name);
  }
  const size_t at = e_.sched->position();
  if (e_.sched->on_use(u) == sched::Use::kDeparted) {
    log::warn_once("engine:trace",
                   fmt::format("use {} of the step (unit {}) differs from the recorded order; "
                               "re-recording it (prefetching resumes after this step; reported "
                               "once)",
                               at, e_.units[u].name));
  }
  return Status::ok();
}

Result<TensorRef> Gatherer::begin_use(size_t u, TensorHandle& resident) {
  UnitState& st = e_.unit_states[u];
  auto full = [&](void* data) {
    return TensorRef{.data = data, .dtype = e_.s.dtype, .numel = st.layout.numel_padded};
  };
  if (!e_.policy.sharded_params) {
    ZINF_ASSIGN_OR_RETURN(resident, e_.store->acquire(st.params, Tier::kDevice));
    ++st.scopes;
    return full(resident.data());
  }
  if (st.live()) {
    ++(st.used_since_gather ? e_.schedule_now.uses_served_kept : e_.schedule_now.uses_served_ahead);
  } else {
    if (Status updated = optimizer_.behind().wait_unit(u); !updated.is_ok()) {
      // The walk has ended (it failed): the step is incomplete until step() finishes it.
      (void)optimizer_.behind().wait();
      e_.update_incomplete = true;
      return std::move(updated).with_context(fmt::format(
          "the optimizer update of step {}, which ran behind step() (update_behind), did not "
          "reach unit {}; call step() again to finish it, then run this pass's micro-steps "
          "again (its gradients are dropped)",
          e_.steps, e_.units[u].name));
    }
    ZINF_RETURN_IF_ERROR(start(u).with_context("gathering unit " + e_.units[u].name));
    ++e_.schedule_now.gathers_on_demand;
  }
  ++st.scopes;
  st.used_since_gather = true;
  Status ahead = plan_ahead();
  // With updates fused into backward, the unit's last use of the step is followed by its update,
  // which takes the shard from the host (or, when it stays on the device between passes, copies
  // it from there itself, off this thread).
  const bool for_update = e_.updates.fused && e_.s.param_home == Tier::kNvme &&
                          !e_.updates.params_stay_on_device &&
                          EngineState::compute_tier(st) == Tier::kHost && e_.sched->following() &&
                          !e_.sched->next_use(u);
  Status mine = finish(u, for_update);
  if (!ahead.is_ok() || !mine.is_ok()) {
    end_use(u);
    return ahead.is_ok() ? mine : ahead;
  }
  return full(st.gathered_data());
}

void Gatherer::end_use(size_t u) {
  UnitState& st = e_.unit_states[u];
  --st.scopes;
  if (e_.policy.sharded_params && st.scopes == 0 && !st.persistent && !e_.sched->keep(u)) {
    drop(u);
  }
}

Status Gatherer::start(size_t u) {
  UnitState& st = e_.unit_states[u];
  const uint64_t wsize = dtype_size(e_.s.dtype);
  ZINF_ASSIGN_OR_RETURN(TensorHandle shard, e_.store->acquire(st.params, Tier::kDevice));
  if (e_.world == 1) {  // the shard is the unit: its device copy serves the uses as it is
    st.shard_view = std::move(shard);
  } else {
    ZINF_ASSIGN_OR_RETURN(
        DeviceBuffer full,
        e_.store->allocate_device(st.layout.numel_padded * wsize, MemoryCategory::kParameters,
                                  "gathered parameters of " + e_.units[u].name));
    st.gather_issued = trace::Clock::now();
    Device::CommWindow in =
        e_.comm_window(shard.data(), st.layout.shard_numel * wsize, Device::WindowAccess::kRead);
    Device::CommWindow out =
        e_.comm_window(full.data(), st.layout.numel_padded * wsize, Device::WindowAccess::kWrite);
    st.gather_work = e_.comm.all_gather(in.data(), out.data(), st.layout.shard_numel, e_.s.dtype);
    st.gather_windows.push_back(std::move(in));
    st.gather_windows.push_back(std::move(out));
    st.gather_in_flight = true;
    st.gathering_shard = std::move(shard);
    st.gathered = std::move(full);
    e_.comm_now.param_gather_elements += st.layout.numel_padded;
  }
  st.used_since_gather = false;
  e_.sched->set_live(u, true);
  e_.schedule_now.peak_live_elements =
      std::max(e_.schedule_now.peak_live_elements, e_.sched->live_elements());
  return Status::ok();
}

Status Gatherer::finish(size_t u, bool for_update) {
  UnitState& st = e_.unit_states[u];
  if (st.shard_view) {  // (one rank) nothing in flight; the copy stays until drop()
    if (for_update) keep_for_update(u);
    return Status::ok();
  }
  if (!st.gather_in_flight) return Status::ok();
  Status ws = st.gather_work.wait();
  if (trace::enabled()) {
    trace::complete(e_.track("comm"), "all-gather " + e_.units[u].name, st.gather_issued);
  }
  st.gather_in_flight = false;
  st.gather_work = comm::Work();
  // The gathered parameters reach the device as the windows close.
  if (Status closed = close_windows(st.gather_windows); ws.is_ok()) ws = std::move(closed);
  st.gathering_shard.release();
  if (for_update && ws.is_ok()) keep_for_update(u);
  e_.release_offloaded(st.params, e_.s.param_home, Tier::kDevice);
  if (!ws.is_ok()) {
    drop(u);
    return std::move(ws).with_context("gathering unit " + e_.units[u].name);
  }
  return Status::ok();
}

void Gatherer::keep_for_update(size_t u) {
  // An optimisation only: when the host has no room, the update reads the shard as before.
  const TensorId params = e_.unit_states[u].params;
  auto host = e_.store->acquire(params, Tier::kHost);
  if (!host.is_ok()) {
    log::debug("engine: {} not kept on the host for its update: {}", e_.units[u].name,
               host.status().to_string());
    return;
  }
  host->release();
  // Until the update takes it: when updates lag behind the backward pass, the reads ahead for
  // those before it must not evict it (it would be read back from NVMe).
  e_.store->keep_for_use(params, Tier::kHost);
}

void Gatherer::drop(size_t u) {
  UnitState& st = e_.unit_states[u];
  if (st.gather_in_flight) {
    Status ws = finish(u);  // (which drops the unit itself when it failed)
    if (!ws.is_ok() && e_.sticky.is_ok()) e_.sticky = std::move(ws);
  }
  st.gathered.reset();
  if (st.shard_view) {
    st.shard_view.release();
    if (e_.updates.params_stay_on_device) {
      e_.store->set_next_use(st.params, optimizer_.next_walk_tick(u));
    } else {
      e_.release_offloaded(st.params, e_.s.param_home, Tier::kDevice);
    }
  }
  e_.sched->set_live(u, false);
}

Status Gatherer::plan_ahead() {
  if (!e_.policy.sharded_params || !e_.sched->following()) return Status::ok();
  const uint64_t base_tick = static_cast<uint64_t>(e_.steps) * e_.sched->trace().size();
  if (e_.s.param_home != Tier::kDevice) {
    for (size_t u : e_.sched->reads_ahead()) {
      if (!optimizer_.behind().unit_ready(u)) continue;  // its update is still to write the shard
      const UnitState& st = e_.unit_states[u];
      if (auto next = e_.sched->next_use(u)) e_.store->set_next_use(st.params, base_tick + *next);
      e_.store->prefetch(st.params, Tier::kDevice);
    }
  }
  // start() waits for the unit's shard to be in memory, holding up the use that called this. With
  // one rank a gather is the shard itself, with no order of collectives to keep across ranks, so
  // one call waits for at most one shard still being read (the first, needed soonest): the units
  // after it are left to the next use's call (or their own use), once their reads (asked for
  // above) have landed. With several ranks every rank must issue the collectives in the same
  // order, which a rule that depends on when a read lands would not keep: all are started here.
  const bool one_wait = e_.comm.world_size() == 1 && e_.s.param_home != Tier::kDevice;
  bool waited = false;
  for (size_t u : e_.sched->gathers_ahead()) {
    if (!optimizer_.behind().unit_ready(u)) break;  // (one rank only: see BehindWalk)
    if (one_wait &&
        !e_.store->residency(e_.unit_states[u].params).valid[static_cast<int>(Tier::kDevice)]) {
      if (waited) break;  // (in order: nothing after it either)
      waited = true;
    }
    ZINF_RETURN_IF_ERROR(start(u));
    ++e_.schedule_now.gathers_ahead;
  }
  return Status::ok();
}

void Gatherer::drop_all() {
  for (size_t u = 0; u < e_.unit_states.size(); ++u) {
    if (e_.unit_states[u].live() || e_.unit_states[u].gather_in_flight) drop(u);
  }
}

Status Gatherer::share_updated_parameters() {
  std::vector<TensorHandle> handles;
  std::vector<Device::CommWindow> windows;
  std::vector<comm::Work> works;
  const uint64_t wsize = dtype_size(e_.s.dtype);
  Status first;
  for (UnitState& st : e_.unit_states) {
    auto h = e_.store->acquire(st.params, Tier::kDevice);
    if (!h.is_ok()) {  // the all-gathers issued so far write into `handles`: let them finish
      first = h.status();
      break;
    }
    // In place: the rank's own shard is inside the gathered tensor.
    Device::CommWindow w =
        e_.comm_window(h->data(), st.layout.numel_padded * wsize, Device::WindowAccess::kReadWrite);
    auto* full = static_cast<char*>(w.data());
    works.push_back(e_.comm.all_gather(full + st.layout.shard_begin(e_.rank) * wsize, full,
                                       st.layout.shard_numel, e_.s.dtype));
    windows.push_back(std::move(w));
    e_.comm_now.param_gather_elements += st.layout.numel_padded;
    h->mark_dirty();
    handles.push_back(std::move(h).value());
  }
  for (auto& w : works) {
    Status ws = w.wait();
    if (first.is_ok() && !ws.is_ok()) first = std::move(ws);
  }
  if (Status closed = close_windows(windows); first.is_ok()) first = std::move(closed);
  return first;
}

}  // namespace zinf::engine_detail
