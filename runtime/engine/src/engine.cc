#include "zinf/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "checkpoint.h"
#include "engine_impl.h"
#include "zinf/core/log.h"
#include "zinf/core/state_bytes.h"
#include "zinf/core/trace.h"
#include "zinf/engine/budgets.h"

namespace zinf {

using engine_detail::PieceState;
using engine_detail::UnitState;

// ---- UnitScope ----------------------------------------------------------------------------------

UnitScope& UnitScope::operator=(UnitScope&& o) noexcept {
  if (this != &o) {
    if (engine_) (void)finish();
    engine_ = std::exchange(o.engine_, nullptr);
    unit_ = o.unit_;
    params_ = std::exchange(o.params_, nullptr);
    param_handle_ = std::move(o.param_handle_);
    grads_ = std::move(o.grads_);
    params_window_ = std::exchange(o.params_window_, std::nullopt);
    grads_window_ = std::exchange(o.grads_window_, std::nullopt);
    opened_ = o.opened_;
  }
  return *this;
}

// A failure at scope end is recorded by finish() and reported by the next gather() or step().
UnitScope::~UnitScope() { (void)finish(); }

const zero::ShardLayout& UnitScope::layout() const { return engine_->layout(unit_); }

TensorView UnitScope::params() const {
  const auto& l = layout();
  return TensorView(params_, engine_->settings_.dtype, l.numel_padded,
                    "the parameters of unit " + engine_->unit_spec(unit_).name);
}

Result<TensorView> UnitScope::grads() {
  if (engine_ == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "grads() of a scope that has ended");
  }
  return engine_->scope_grads(*this);
}

Status UnitScope::params_to_host(std::span<float> out) const {
  return params_to_f32(out.data(), out.size(), "params_to_host");
}

Status UnitScope::params_to_device(DeviceSpan<float> out) const {
  return params_to_f32(out.data, out.size, "params_to_device");
}

Status UnitScope::grads_from_host(std::span<const float> in) {
  return grads_from_f32(in.data(), in.size(), "grads_from_host");
}

Status UnitScope::grads_from_device(DeviceSpan<const float> in) {
  return grads_from_f32(in.data, in.size, "grads_from_device");
}

Result<const float*> UnitScope::params_in_place() {
  if (engine_ == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "params_in_place() of a scope that has ended");
  }
  if (engine_->settings_.dtype != DType::kF32) return nullptr;
  if (!params_window_) {
    // The gather's writes come before the stream's present point (Gatherer::begin_use).
    ZINF_RETURN_IF_ERROR(
        engine_detail::sync(engine_->stream())
            .with_context("reading the parameters of unit " + engine_->unit_spec(unit_).name));
    params_window_ = engine_->device().host_window(params_, layout().numel_padded * 4);
    if (!params_window_) return nullptr;
  }
  return static_cast<const float*>(params_);
}

Result<float*> UnitScope::grads_in_place() {
  if (engine_ == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "grads_in_place() of a scope that has ended");
  }
  if (engine_->settings_.dtype != DType::kF32) return nullptr;
  if (!grads_window_) {
    if (!grads_) {
      // A buffer that does not fit beside the open units' now is no error: the model sums in a
      // copy and the buffer is taken at the scope's end, as without this window.
      Status taken = engine_->allocate_scope_grads(*this);
      if (taken.code() == ErrorCode::kOutOfMemory) return nullptr;
      ZINF_RETURN_IF_ERROR(taken);
    }
    // The buffer's zeroing, enqueued with its allocation, completes before the model writes.
    ZINF_RETURN_IF_ERROR(
        engine_detail::sync(engine_->stream())
            .with_context("zeroing the gradients of unit " + engine_->unit_spec(unit_).name));
    grads_window_ = engine_->device().host_window(grads_.data(), grads_.bytes());
    if (!grads_window_) return nullptr;
  }
  return static_cast<float*>(grads_.data());
}

Status UnitScope::params_to_f32(void* out, uint64_t size, const char* caller) const {
  if (engine_ == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "{}() of a scope that has ended", caller);
  }
  const auto& l = layout();
  if (size < l.numel) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: unit {} has {} parameters, the buffer holds {}", caller,
                      engine_->unit_spec(unit_).name, l.numel, size);
  }
  Stream& stream = engine_->stream();
  engine_->device().cast({.data = out, .dtype = DType::kF32, .numel = l.numel},
                         {params_, engine_->settings_.dtype, l.numel}, stream);
  return engine_detail::sync(stream).with_context("reading the parameters of unit " +
                                                  engine_->unit_spec(unit_).name);
}

Status UnitScope::grads_from_f32(const void* in, uint64_t size, const char* caller) {
  ZINF_ASSIGN_OR_RETURN(TensorView g, grads());
  const auto& l = layout();
  if (size != l.numel) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: unit {} has {} parameters, got {} gradients", caller,
                      engine_->unit_spec(unit_).name, l.numel, size);
  }
  Stream& stream = engine_->stream();
  TensorRef dst = g.ref();
  dst.numel = l.numel;  // the padding stays zero
  engine_->device().cast(dst, {in, DType::kF32, l.numel}, stream);
  return engine_detail::sync(stream).with_context("writing the gradients of unit " +
                                                  engine_->unit_spec(unit_).name);
}

Status UnitScope::finish() {
  if (engine_ == nullptr) return Status::ok();
  Engine* e = std::exchange(engine_, nullptr);
  Status s = e->end_scope(*this);
  if (!s.is_ok() && e->impl_->e.sticky.is_ok()) e->impl_->e.sticky = s;
  return s;
}

// ---- Engine -------------------------------------------------------------------------------------

Engine::Engine(const EngineSettings& settings, std::unique_ptr<Impl> impl)
    : settings_(settings), impl_(std::move(impl)) {}

Engine::~Engine() {
  if (!impl_) return;
  (void)impl_->settle_behind();
  (void)impl_->reducer.drain();
  (void)impl_->optimizer.fused().wait();
  impl_->gatherer.drop_all();  // waits for all-gathers still writing into gathered buffers
  // After a failure some reductions may still be in flight: their buffers belong to the
  // communicator until their Work completes.
  impl_->reducer.abandon();
  (void)impl_->e.finish_evictions();
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineSettings& settings,
                                               comm::Communicator& comm,
                                               std::vector<zero::UnitSpec> units, InitFn init) {
  if (units.empty()) return make_error(ErrorCode::kInvalidArgument, "the model has no units");
  if (!init) return make_error(ErrorCode::kInvalidArgument, "no parameter initialiser given");
  auto impl = std::make_unique<Impl>(settings, comm);
  impl->e.units = std::move(units);
  impl->e.init = std::move(init);
  ZINF_RETURN_IF_ERROR(impl->build());
  impl->e.ledger.reset_peaks();
  impl->e.comm.reset_counters();               // the budget agreement is not part of the first step
  const EngineSettings effective = impl->e.s;  // with the budgets chosen
  return std::unique_ptr<Engine>(new Engine(effective, std::move(impl)));
}

Result<UnitScope> Engine::gather(size_t unit) {
  engine_detail::EngineState& e = impl_->e;
  if (!e.sticky.is_ok()) return std::exchange(e.sticky, Status());
  if (unit >= e.unit_states.size()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} does not exist ({} units)", unit,
                      e.unit_states.size());
  }
  ZINF_RETURN_IF_ERROR(impl_->gatherer.on_use(unit));
  UnitScope scope;
  scope.unit_ = unit;
  scope.opened_ = trace::Clock::now();
  ZINF_ASSIGN_OR_RETURN(const TensorRef params,
                        impl_->gatherer.begin_use(unit, scope.param_handle_));
  scope.params_ = params.data;
  scope.engine_ = this;  // from here on the scope's end undoes the use
  return scope;
}

Status Engine::allocate_scope_grads(UnitScope& scope) {
  engine_detail::EngineState& e = impl_->e;
  if (scope.grads_) return Status::ok();
  // Reductions that completed since the last issue give back their buffers first (a reap that
  // cannot get an accumulator leaves the reduction queued: it never fails here for memory). Any
  // other failure lost that reduction's gradients: it fails the step (sticky), and this scope
  // goes on, so that its own reduction is still issued on every rank alike.
  if (Status reaped = impl_->reducer.reap(); !reaped.is_ok() && e.sticky.is_ok()) {
    e.sticky = std::move(reaped);
  }
  const auto& l = e.unit_states[scope.unit_].layout;
  ZINF_ASSIGN_OR_RETURN(
      DeviceBuffer g,
      e.store->allocate_device(l.numel_padded * dtype_size(e.s.dtype), MemoryCategory::kGradients,
                               "gradient buffer of " + e.units[scope.unit_].name));
  // Zeroed on the engine's stream: the model's operations on it come after in stream order,
  // and the scope's end waits for the stream (and reports a failure) before reducing.
  e.device->fill({.data = g.data(), .dtype = DType::kF32, .numel = g.bytes() / 4}, 0.0f, *e.stream);
  scope.grads_ = std::move(g);
  return Status::ok();
}

Result<TensorView> Engine::scope_grads(UnitScope& scope) {
  engine_detail::EngineState& e = impl_->e;
  ZINF_RETURN_IF_ERROR(allocate_scope_grads(scope));
  return TensorView(scope.grads_.data(), e.s.dtype, e.unit_states[scope.unit_].layout.numel_padded,
                    "the gradients of unit " + e.units[scope.unit_].name);
}

Status Engine::end_scope(UnitScope& scope) {
  engine_detail::EngineState& e = impl_->e;
  // The model's own operations on the scope's buffers (on stream()) finish before the gradients
  // are reduced and the gathered parameters are let go.
  Status ops = engine_detail::sync(*e.stream);
  scope.params_window_.reset();  // the model is done with them
  scope.grads_window_.reset();
  if (trace::enabled()) {
    trace::complete(e.track("compute"),
                    (scope.grads_ ? "backward " : "forward ") + e.units[scope.unit_].name,
                    scope.opened_);
  }
  scope.param_handle_.release();
  scope.params_ = nullptr;
  impl_->gatherer.end_use(scope.unit_);
  // The reduction is issued whatever failed here, so that every rank's collectives stay in step;
  // the failure fails this rank's step (and so every rank's: StepAgreement).
  Status issued;
  if (scope.grads_) issued = impl_->reducer.issue(scope.unit_, std::move(scope.grads_));
  if (!ops.is_ok()) {
    return std::move(ops).with_context("operations on unit " + e.units[scope.unit_].name);
  }
  return issued;
}

Status Engine::step() {
  engine_detail::EngineState& e = impl_->e;
  StepInfo info;
  Status st = impl_->step(info);
  // This call's update ended here, unless it runs on behind it (its entry comes when waited for).
  if (!impl_->optimizer.behind().pending()) {
    e.record_update_end(e.store->stats(), std::chrono::steady_clock::now());
  }
  last_step_ = info;
  last_comm_ = e.comm_now;
  last_comm_.counters = e.comm.counters();
  e.comm.reset_counters();
  e.comm_now = CommReport{};
  last_schedule_ = e.schedule_now;
  last_schedule_.departures = e.sched->departures();
  e.schedule_now = ScheduleReport{.sub_groups = impl_->optimizer.sub_groups()};
  return st;
}

namespace {
Status refuse_mid_step(std::string_view what) {
  return make_error(ErrorCode::kInvalidArgument,
                    "{}: an optimizer update of this step already started during the backward "
                    "pass (overlap_optimizer); set it between step() and the next step's first "
                    "gather",
                    what);
}
}  // namespace

Status Engine::set_lr(float lr) {
  if (!(std::isfinite(lr) && lr >= 0)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "set_lr: expected a finite learning rate >= 0, got {}", lr);
  }
  if (impl_->optimizer.fused().started()) return refuse_mid_step("set_lr");
  impl_->e.s.adam.lr = lr;
  settings_.adam.lr = lr;
  return Status::ok();
}

Status Engine::set_betas(float beta1, float beta2) {
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "set_betas: expected two numbers in [0, 1), got [{}, {}]", beta1, beta2);
  }
  if (impl_->optimizer.fused().started()) return refuse_mid_step("set_betas");
  impl_->e.s.adam.beta1 = beta1;
  impl_->e.s.adam.beta2 = beta2;
  settings_.adam.beta1 = beta1;
  settings_.adam.beta2 = beta2;
  return Status::ok();
}

float Engine::loss_scale() const { return impl_->scaler.scale(); }

Device& Engine::device() const { return *impl_->e.device; }
Stream& Engine::stream() const { return *impl_->e.stream; }
const Budgets& Engine::budgets() const { return impl_->e.budgets; }

StoreStats Engine::store_stats() const { return impl_->e.store->stats(); }

Status Engine::wait_for_update() { return impl_->settle_behind(); }

std::vector<Engine::UpdateEnd> Engine::update_ends() const {
  return {impl_->e.update_ends.begin(), impl_->e.update_ends.end()};
}

NvmeTraffic nvme_traffic_minimum(const NvmeTrafficInputs& in) {
  const uint64_t w = dtype_size(in.dtype);
  const bool mixed = in.dtype != DType::kF32;
  const uint64_t gas = static_cast<uint64_t>(std::max(1, in.gradient_accumulation_steps));
  // Without clipping (and without fp16's overflow check) each unit can be updated as soon as
  // its gradient is final, during the last backward pass.
  const bool fused = !in.clipping && in.dtype != DType::kF16;
  const uint64_t optimizer_state =
      optimizer_state_bytes_per_element(in.dtype, Accumulator::kExcluded);
  NvmeTraffic t;
  // Every micro-step's forward and backward pass gathers each unit: its shard is read twice. A
  // persistent unit is gathered once per step and kept: read once.
  const uint64_t persistent = std::min(in.persistent_param_elements, in.param_elements);
  t.read_bytes += (2 * gas * (in.param_elements - persistent) + persistent) * w;
  t.read_bytes += in.optimizer_elements * optimizer_state;
  // In fp32 the parameter is the master: an update after the backward pass reads it once more,
  // unless the next forward pass takes the parameters it updated from memory (update_behind).
  if (!mixed && !fused && !in.update_behind) t.read_bytes += in.param_elements * 4;
  t.written_bytes += in.optimizer_elements * optimizer_state + in.param_elements * w;
  // Accumulators wait for the next micro-step's gradients and, unless the update is fused, for
  // the last gradient (the norm, the overflow check): at each wait what the host budget cannot
  // hold is on NVMe, written and read back.
  const uint64_t waits = fused ? gas - 1 : gas;
  if (in.accumulator_bytes > in.host_room_bytes) {
    t.gradient_spill_bytes = waits * (in.accumulator_bytes - in.host_room_bytes);
  }
  return t;
}

NvmeTraffic Engine::nvme_traffic_minimum() const {
  const engine_detail::EngineState& e = impl_->e;
  NvmeTrafficInputs in{.dtype = e.s.dtype,
                       .gradient_accumulation_steps = e.s.gradient_accumulation_steps,
                       .clipping = e.s.gradient_clipping > 0,
                       .update_behind = e.updates.behind};
  for (const engine_detail::UnitState& st : e.unit_states) {
    if (e.s.param_home == Tier::kNvme) {
      in.param_elements += e.policy.param_elements(st.layout);
      if (st.persistent) in.persistent_param_elements += e.policy.param_elements(st.layout);
    }
    if (st.opt_home == Tier::kNvme) {
      in.optimizer_elements += e.policy.owned_elements(st.layout);
      in.accumulator_bytes += e.policy.accumulator_elements(st.layout) * 4;
    }
  }
  const uint64_t held = e.staging_total + e.sizes.host_home_bytes;
  in.host_room_bytes = e.s.host_mem > held ? e.s.host_mem - held : 0;
  return zinf::nvme_traffic_minimum(in);
}

MemoryReport Engine::memory_report() const {
  MemoryReport r;
  for (int t = 0; t < kNumTiers; ++t) r.tiers[t] = impl_->e.ledger.usage(static_cast<Tier>(t));
  return r;
}

Result<std::vector<float>> Engine::full_parameters(size_t unit) {
  engine_detail::EngineState& e = impl_->e;
  if (unit >= e.unit_states.size()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} does not exist", unit);
  }
  ZINF_RETURN_IF_ERROR(impl_->settle_behind());
  ZINF_RETURN_IF_ERROR(impl_->reducer.drain());
  ZINF_RETURN_IF_ERROR(impl_->optimizer.fused().wait());
  UnitState& st = e.unit_states[unit];
  const auto& l = st.layout;
  std::vector<float> full(l.numel_padded);
  // Each rank contributes its owned fp32 values; a rank that owns every shard contributes its
  // shard-sized slice like the others.
  std::vector<float> mine(l.shard_numel);
  const uint64_t begin = l.shard_begin(e.rank);
  if (e.mixed) {
    for (size_t pi : st.pieces) {  // the pieces of this rank's shard
      const PieceState& p = e.pieces[pi];
      if (p.begin < begin || p.end > l.shard_end(e.rank)) continue;
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, e.store->acquire(p.master, Tier::kHost));
      std::memcpy(mine.data() + (p.begin - begin), h.data(), (p.end - p.begin) * 4);
    }
  } else {
    ZINF_ASSIGN_OR_RETURN(TensorHandle h, e.store->acquire(st.params, Tier::kHost));
    std::memcpy(mine.data(), static_cast<float*>(h.data()) + e.param_index(st, begin),
                l.shard_numel * 4);
  }
  ZINF_RETURN_IF_ERROR(
      e.comm.all_gather(mine.data(), full.data(), l.shard_numel, DType::kF32).wait());
  e.comm.reset_counters();
  full.resize(l.numel);
  return full;
}

// ---- checkpoints --------------------------------------------------------------------------------
//
// The scalars the engine's parts keep: with the tensors, all a resumed run needs to continue
// exactly as the uninterrupted one.

Result<std::string> Engine::save_checkpoint(const std::string& root,
                                            const SaveCheckpointOptions& options) {
  ZINF_RETURN_IF_ERROR(impl_->settle_behind());
  const engine_detail::LossScaler::State ls = impl_->scaler.state();
  const nlohmann::json scalars = {{"optimizer_steps", impl_->e.steps},
                                  {"step_calls", impl_->step_calls},
                                  {"skipped_steps", impl_->skipped_steps},
                                  {"nonfinite_in_a_row", impl_->nonfinite_in_a_row},
                                  {"loss_scale", ls.scale},
                                  {"loss_scale_good_steps", ls.good_steps},
                                  {"loss_scale_hysteresis_left", ls.hysteresis_left}};
  return engine_detail::save_checkpoint(impl_->e, scalars, root, options);
}

Result<LoadedCheckpoint> Engine::load_checkpoint(const std::string& path) {
  ZINF_RETURN_IF_ERROR(impl_->settle_behind());
  ZINF_ASSIGN_OR_RETURN(engine_detail::LoadedState loaded,
                        engine_detail::load_checkpoint(impl_->e, path));
  const nlohmann::json& j = loaded.scalars;
  try {
    impl_->e.steps = j.at("optimizer_steps").get<int64_t>();
    impl_->step_calls = j.at("step_calls").get<int64_t>();
    impl_->skipped_steps = j.at("skipped_steps").get<int64_t>();
    impl_->nonfinite_in_a_row = j.at("nonfinite_in_a_row").get<uint64_t>();
    impl_->scaler.restore({.scale = j.at("loss_scale").get<float>(),
                           .good_steps = j.at("loss_scale_good_steps").get<int>(),
                           .hysteresis_left = j.at("loss_scale_hysteresis_left").get<int>()});
  } catch (const std::exception& ex) {
    return make_error(ErrorCode::kCorrupt, "{}/manifest.json: the engine's state: {}",
                      loaded.info.path, ex.what());
  }
  loaded.info.optimizer_steps = impl_->e.steps;
  last_step_ = StepInfo{.step = impl_->e.steps,
                        .skipped_steps = impl_->skipped_steps,
                        .nonfinite_in_a_row = impl_->nonfinite_in_a_row,
                        .loss_scale = impl_->scaler.scale()};
  return std::move(loaded.info);
}

size_t Engine::unit_count() const { return impl_->e.unit_states.size(); }
const zero::ShardLayout& Engine::layout(size_t unit) const {
  return impl_->e.unit_states.at(unit).layout;
}
const zero::UnitSpec& Engine::unit_spec(size_t unit) const { return impl_->e.units.at(unit); }
int Engine::rank() const { return impl_->e.rank; }
int Engine::world_size() const { return impl_->e.world; }

}  // namespace zinf
