#include "zinf/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine_state.h"
#include "gatherer.h"
#include "grad_reducer.h"
#include "loss_scaler.h"
#include "optimizer_pipeline.h"
#include "step_agreement.h"
#include "zinf/core/log.h"
#include "zinf/core/trace.h"
#include "zinf/core/units.h"
#include "zinf/engine/budgets.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/sched/sub_groups.h"

namespace zinf {

using engine_detail::kNoTensor;
using engine_detail::PieceState;
using engine_detail::UnitState;

namespace {
constexpr uint32_t kStoreMovers = 2;  // the store's mover threads (each has a staging lane)
}  // namespace

// One rank's engine: the shared state and the parts that work on it, each with one job
// (docs/architecture.md, "The engine's parts").
struct Engine::Impl {
  engine_detail::EngineState e;
  engine_detail::LossScaler scaler;
  engine_detail::StepAgreement agreement;  // counts into e.comm_now.control_elements
  engine_detail::OptimizerPipeline optimizer;
  engine_detail::GradReducer reducer;
  engine_detail::Gatherer gatherer;

  Impl(const EngineSettings& settings, comm::Communicator& c)
      : e(settings, c),
        scaler(settings),
        agreement(c, e.comm_now.control_elements),
        optimizer(e, scaler),
        reducer(e, optimizer),
        gatherer(e) {}

  // ---- building ---------------------------------------------------------------------------------

  Status validate() const {
    const EngineSettings& s = e.s;
    if (s.stage < 0 || s.stage > 3) {
      return make_error(ErrorCode::kInvalidArgument, "ZeRO stage must be 0..3, got {}", s.stage);
    }
    if (s.param_home != Tier::kDevice && !e.policy.sharded_params) {
      return make_error(ErrorCode::kInvalidArgument,
                        "parameter offload needs ZeRO stage 3 (stage is {})", s.stage);
    }
    if ((s.param_home == Tier::kNvme || s.optimizer_home == Tier::kNvme) && s.nvme_paths.empty()) {
      return make_error(ErrorCode::kInvalidArgument, "NVMe offload needs at least one nvme_path");
    }
    if (s.gradient_accumulation_steps < 1) {
      return make_error(ErrorCode::kInvalidArgument,
                        "gradient_accumulation_steps must be at least 1, got {}",
                        s.gradient_accumulation_steps);
    }
    if (!(s.optimizer_offload_ratio > 0 && s.optimizer_offload_ratio <= 1)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "offload_optimizer.ratio must be in (0, 1], got {}",
                        s.optimizer_offload_ratio);
    }
    return Status::ok();
  }

  // Partial offload (DeepSpeed's Twin-Flow `ratio`): the first units, in declaration order,
  // holding about `ratio` of the parameters have their optimizer state offloaded; the others keep
  // it on the device and are updated there. Whole units: the optimizer's home of each.
  std::vector<Tier> optimizer_homes(const std::vector<zero::ShardLayout>& layouts) const {
    const EngineSettings& s = e.s;
    uint64_t total_numel = 0, offloaded_numel = 0;
    for (const auto& l : layouts) total_numel += l.numel;
    std::vector<Tier> homes;
    for (const auto& l : layouts) {
      const bool offload = s.optimizer_home != Tier::kDevice &&
                           static_cast<double>(offloaded_numel) + l.numel / 2.0 <=
                               s.optimizer_offload_ratio * static_cast<double>(total_numel);
      if (offload) offloaded_numel += l.numel;
      homes.push_back(offload ? s.optimizer_home : Tier::kDevice);
    }
    return homes;
  }

  // Resolves automatic budgets (device_mem / host_mem 0) into e.s from the model's sizes and the
  // machine (zinf/engine/budgets.h); explicit ones are kept. Every rank then takes the smallest
  // of the ranks' budgets: the scheduler's decisions depend on the device budget, and every rank
  // must issue the same all-gathers (MemAvailable differs between ranks and over time).
  Status choose_budgets_for(const std::vector<zero::ShardLayout>& layouts,
                            const std::vector<Tier>& opt_homes, bool nvme) {
    const EngineSettings& s = e.s;
    const uint64_t wsize = dtype_size(s.dtype);
    e.staging_total = nvme ? uint64_t{kStoreMovers + 1} * std::max<uint32_t>(s.staging_buffers, 2) *
                                 s.staging_bytes
                           : 0;
    StateSizes z{.staging_bytes = e.staging_total,
                 .optimizer_offloaded = s.optimizer_home != Tier::kDevice,
                 .world = e.world,
                 .nvme = nvme,
                 .params_offloaded = s.param_home != Tier::kDevice};
    for (size_t u = 0; u < layouts.size(); ++u) {
      const zero::ShardLayout& l = layouts[u];
      z.largest_unit_elements = std::max(z.largest_unit_elements, l.numel_padded);
      z.total_unit_elements += l.numel_padded;
      const uint64_t params = e.policy.param_elements(l) * wsize;
      e.largest_param_bytes = std::max(e.largest_param_bytes, params);
      if (s.param_home == Tier::kDevice) z.device_home_bytes += params;
      if (s.param_home == Tier::kHost) z.host_home_bytes += params;
      // fp32 m, v, gradient accumulator (and master when mixed) of the elements this rank owns,
      // where the unit's optimizer lives.
      const uint64_t opt_bytes =
          e.policy.owned_elements(l) * (e.mixed ? 12 : 8) + e.policy.accumulator_elements(l) * 4;
      if (opt_homes[u] == Tier::kDevice) z.device_home_bytes += opt_bytes;
      if (opt_homes[u] == Tier::kHost) z.host_home_bytes += opt_bytes;
    }
    z.largest_param_bytes = e.largest_param_bytes;
    MachineMemory machine{.total_bytes = uint64_t{1} << 40, .available_bytes = uint64_t{1} << 40};
    if (s.device_mem == 0 || s.host_mem == 0) {
      ZINF_ASSIGN_OR_RETURN(machine, read_machine_memory());
    }
    e.sizes = z;
    const bool local = e.comm.backend() == comm::Backend::kLocal;
    e.budgets = choose_budgets(s, z, machine, ranks_on_this_machine(local, e.world));
    if (e.world > 1) {
      ZINF_ASSIGN_OR_RETURN(e.budgets.device_bytes, smallest_of_ranks(e.budgets.device_bytes));
      ZINF_ASSIGN_OR_RETURN(e.budgets.host_bytes, smallest_of_ranks(e.budgets.host_bytes));
    }
    e.s.device_mem = e.budgets.device_bytes;
    e.s.host_mem = e.budgets.host_bytes;
    return Status::ok();
  }

  // The smallest of every rank's `value` (all-gathered as raw 32-bit words).
  Result<uint64_t> smallest_of_ranks(uint64_t value) {
    std::vector<uint64_t> all(e.world);
    ZINF_RETURN_IF_ERROR(
        e.comm.all_gather(&value, all.data(), sizeof(uint64_t) / 4, DType::kF32).wait());
    return *std::min_element(all.begin(), all.end());
  }

  // This rank's resources: device and streams, NVMe swap, pinned host pool, the store over them.
  Status open_tiers(bool nvme) {
    const EngineSettings& s = e.s;
    ZINF_ASSIGN_OR_RETURN(const DeviceKind kind, resolve_device_kind(s.device));
    ZINF_ASSIGN_OR_RETURN(e.device, make_device(kind, {.budget_bytes = s.device_mem,
                                                       .ledger = &e.ledger,
                                                       .threads = s.optimizer_threads}));
    e.stream = e.device->create_stream(e.track("engine"));
    e.optimizer_stream = e.device->create_stream(e.track("optimizer"));
    if (nvme) {
      ZINF_ASSIGN_OR_RETURN(e.io, io::IoEngine::create({.queue_depth = s.io_queue_depth,
                                                        .block_size = s.io_block_size,
                                                        .rings = s.io_rings,
                                                        .single_submit = s.io_single_submit}));
      ZINF_ASSIGN_OR_RETURN(e.swap, io::SwapSpace::create(*e.io, {.directories = s.nvme_paths,
                                                                  .checksum = s.checksum}));
    }
    e.pool = std::make_unique<PinnedPool>(PinnedPoolOptions{.budget_bytes = s.host_mem,
                                                            .pin = s.pin_memory,
                                                            .engine = e.io.get(),
                                                            .ledger = &e.ledger});
    ZINF_ASSIGN_OR_RETURN(e.store, TieredTensorStore::create({.device = e.device.get(),
                                                              .host = e.pool.get(),
                                                              .swap = e.swap.get(),
                                                              .ledger = &e.ledger,
                                                              .staging_bytes = s.staging_bytes,
                                                              .staging_buffers = s.staging_buffers,
                                                              .movers = kStoreMovers,
                                                              .trace_name = e.track("")}));
    return Status::ok();
  }

  Status build() {
    e.rank = e.comm.rank();
    e.world = e.comm.world_size();
    e.mixed = e.s.dtype != DType::kF32;
    ZINF_RETURN_IF_ERROR(validate());
    const EngineSettings& s = e.s;
    std::vector<zero::ShardLayout> layouts;
    for (const auto& unit : e.units) {
      ZINF_ASSIGN_OR_RETURN(zero::ShardLayout l, zero::make_shard_layout(unit, e.world, s.dtype));
      layouts.push_back(std::move(l));
    }
    const bool nvme = s.param_home == Tier::kNvme || s.optimizer_home == Tier::kNvme;
    const std::vector<Tier> opt_homes = optimizer_homes(layouts);
    ZINF_RETURN_IF_ERROR(choose_budgets_for(layouts, opt_homes, nvme));
    ZINF_RETURN_IF_ERROR(open_tiers(nvme));

    // The scheduler: its live bound is also held to what fits in the device budget beside the
    // homed state and the unit being worked on (the same on every rank: it depends on the sizes
    // and the budget, never on memory pressure).
    std::vector<uint64_t> unit_elements;
    for (const auto& l : layouts) unit_elements.push_back(l.numel_padded);
    e.sched = std::make_unique<sched::Scheduler>(
        sched::SchedulerOptions{
            .prefetch_elements = s.prefetch_bucket_elements,
            .max_live_elements = std::min(s.max_live_elements,
                                          live_elements_that_fit(e.sizes, s.dtype, s.device_mem)),
            .max_reuse_distance = s.max_reuse_distance},
        unit_elements);

    // Optimizer sub-groups over the ranges this rank owns.
    std::vector<std::vector<sched::ElementRange>> owned;
    for (const auto& l : layouts) owned.push_back(e.policy.owned_ranges(l, e.rank, e.world));
    const sched::SubGroupPlan plan =
        sched::plan_sub_groups(owned, optimizer.sub_group_limit(), kernels::kSumSquaresBlockElems);
    uint64_t acc_bytes = 0;
    for (size_t u = 0; u < e.units.size(); ++u) {
      UnitState st;
      st.layout = layouts[u];
      st.persistent = e.policy.sharded_params && st.layout.numel <= s.param_persistence_threshold;
      st.opt_home = opt_homes[u];
      ZINF_RETURN_IF_ERROR(make_unit_tensors(u, st, plan));
      if (st.opt_home != Tier::kDevice) acc_bytes += e.policy.accumulator_elements(st.layout) * 4;
      e.unit_states.push_back(std::move(st));
      ZINF_RETURN_IF_ERROR(initialise(u));
    }
    optimizer.set_plan(plan, acc_bytes);
    e.schedule_now.sub_groups = optimizer.sub_groups();
    return Status::ok();
  }

  // The unit's parameter tensor and, for each of its pieces of the plan, the optimizer state and
  // gradient accumulator (where the unit's optimizer lives).
  Status make_unit_tensors(size_t u, UnitState& st, const sched::SubGroupPlan& plan) {
    const uint64_t wsize = dtype_size(e.s.dtype);
    const std::string& name = e.units[u].name;
    ZINF_ASSIGN_OR_RETURN(
        st.params, e.make_tensor(name + ".params", e.policy.param_elements(st.layout) * wsize,
                                 e.s.param_home, MemoryCategory::kParameters));
    // A full accumulator (stage 1) is one tensor for the unit, shared by its pieces.
    TensorId shared_acc = kNoTensor;
    if (e.policy.full_grad_accumulator) {
      ZINF_ASSIGN_OR_RETURN(shared_acc, e.make_tensor(name + ".grad_acc",
                                                      e.policy.accumulator_elements(st.layout) * 4,
                                                      st.opt_home, MemoryCategory::kGradients));
    }
    std::vector<size_t> mine;
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      if (plan.pieces[i].unit == u) mine.push_back(i);
    }
    for (size_t k = 0; k < mine.size(); ++k) {
      const sched::Piece& src = plan.pieces[mine[k]];
      PieceState p{.unit = u, .begin = src.range.begin, .end = src.range.end};
      const uint64_t n = p.end - p.begin;
      // "layer0.adam_m", or "layer0.adam_m.1" when the unit's state is in several pieces.
      auto tensor_name = [&](const char* what) {
        return mine.size() == 1 ? fmt::format("{}.{}", name, what)
                                : fmt::format("{}.{}.{}", name, what, k);
      };
      if (e.mixed) {
        ZINF_ASSIGN_OR_RETURN(p.master, e.make_tensor(tensor_name("master"), n * 4, st.opt_home,
                                                      MemoryCategory::kOptimizerStates));
      }
      ZINF_ASSIGN_OR_RETURN(p.m, e.make_tensor(tensor_name("adam_m"), n * 4, st.opt_home,
                                               MemoryCategory::kOptimizerStates));
      ZINF_ASSIGN_OR_RETURN(p.v, e.make_tensor(tensor_name("adam_v"), n * 4, st.opt_home,
                                               MemoryCategory::kOptimizerStates));
      // The fp32 gradient lives with the optimizer state (device, host or NVMe), so that with
      // NVMe offload no training state is bound to memory (the host budget caches it).
      if (shared_acc != kNoTensor) {
        p.acc = shared_acc;
        p.acc_base = 0;
        p.owns_acc = false;
      } else {
        ZINF_ASSIGN_OR_RETURN(p.acc, e.make_tensor(tensor_name("grad_acc"), n * 4, st.opt_home,
                                                   MemoryCategory::kGradients));
        p.acc_base = p.begin;
      }
      // Pieces are made in plan order, so indices into `pieces` match the plan's.
      st.pieces.push_back(e.pieces.size());
      e.pieces.push_back(p);
    }
    return Status::ok();
  }

  // Fills the parameters this rank holds (and its fp32 master) from the init function.
  Status initialise(size_t u) {
    UnitState& st = e.unit_states[u];
    const auto& l = st.layout;
    const EngineSettings& s = e.s;
    const uint64_t p_begin = e.policy.param_begin(l, e.rank);
    const uint64_t p_end = p_begin + e.policy.param_elements(l);
    // fp32 values of [begin, end) of the unit (zero past numel: the padding).
    auto values = [&](uint64_t begin, uint64_t end) {
      std::vector<float> out(end - begin);
      for (uint64_t flat = begin; flat < std::min(end, l.numel); ++flat) {
        out[flat - begin] = e.init(u, flat, s.seed);
      }
      return out;
    };
    {  // written on the host, converted to the working dtype there
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, e.store->acquire(st.params, Tier::kHost));
      const std::vector<float> v = values(p_begin, p_end);
      kernels::cast(v.data(), DType::kF32, h.data(), s.dtype, v.size(), s.optimizer_threads);
      h.mark_dirty();
    }
    if (e.mixed) {
      for (size_t pi : st.pieces) {
        const PieceState& p = e.pieces[pi];
        {
          ZINF_ASSIGN_OR_RETURN(TensorHandle h, e.store->acquire(p.master, Tier::kHost));
          const std::vector<float> v = values(p.begin, p.end);
          std::memcpy(h.data(), v.data(), v.size() * 4);
          h.mark_dirty();
        }
        // Written to its home; the host copy written above is not kept.
        if (st.opt_home != Tier::kHost) ZINF_RETURN_IF_ERROR(e.store->evict(p.master, Tier::kHost));
      }
    }
    // Resident where they are used; the host copy written above is not kept.
    if (s.param_home != Tier::kHost) {
      { ZINF_ASSIGN_OR_RETURN(TensorHandle d, e.store->acquire(st.params, Tier::kDevice)); }
      ZINF_RETURN_IF_ERROR(e.store->evict(st.params, Tier::kHost));
    }
    return Status::ok();
  }

  // ---- the step ---------------------------------------------------------------------------------
  //
  // A step either happens on every rank or on none. Every rank goes through the same collectives
  // whatever failed locally (StepAgreement), so no rank is left waiting in a collective the others
  // skipped; a failure anywhere fails step() everywhere, each rank keeps the pieces it updated,
  // and the next step() finishes the update on every rank.
  Status step(StepInfo& info) {
    Status local = settle_backward(info);
    if (!e.sticky.is_ok()) {  // a scope's end could not issue its reduction: gradients missing
      if (local.is_ok()) local = std::move(e.sticky);
      e.sticky = Status();
    }
    // A write-back that failed is reported, but the data stays valid in memory (and is written
    // back later): the step goes on.
    Status writeback = e.finish_evictions();
    if (local.is_ok()) local = optimizer.zero_untouched_accumulators();
    auto exchanged = global_norm(local);
    if (!exchanged.is_ok()) {  // the exchange itself failed: nothing was updated anywhere
      e.update_incomplete = true;
      return exchanged.status();
    }
    const GlobalNorm norm = *exchanged;
    info.grad_norm = norm.ok ? std::sqrt(norm.sum_squares) : 0;
    // fp16: an overflow skips the update. Every rank sees the same partials and decides the same.
    const bool overflow = norm.ok && scaler.checks_overflow() && !std::isfinite(norm.sum_squares);
    if (norm.ok && !overflow) {
      local =
          optimizer.update({.step = e.steps + 1,
                            .grad_scale = optimizer.combined_scale() * clip_coef(info.grad_norm)},
                           writeback);
    }
    if (Status agreed = agreement.agree(std::move(local)); !agreed.is_ok()) {
      e.update_incomplete = true;  // the next step() finishes it
      return agreed;
    }
    e.update_incomplete = false;
    if (overflow) {
      skip(info);
      return writeback;
    }
    Status committed = commit(info);
    return writeback.is_ok() ? committed : writeback;
  }

  // Settles what the backward pass left in flight — reductions, overlapped updates, gathered
  // units — and closes the step in the scheduler.
  Status settle_backward(StepInfo& info) {
    Status st = reducer.drain();
    if (Status w = optimizer.wait_early(); st.is_ok()) st = std::move(w);
    gatherer.drop_all();
    e.schedule_now.following = e.sched->following();  // of the step that ends here
    if (!e.sched->on_step_end()) {
      log::warn_once("engine:trace-short",
                     "a step used fewer units than the recorded one; re-recording (reported once)");
    }
    optimizer.plan_walk();
    info.units_updated_early = optimizer.take_units_updated_early();
    for (UnitState& u : e.unit_states) u.final_issued = false;
    return st;
  }

  // The global gradient norm from every rank's partial sum of squares, added in rank order; one
  // pass also gives fp16's overflow check (the sum is non-finite exactly when a gradient is).
  // `local` failed: this rank sends the failure sentinel instead of its partial.
  struct GlobalNorm {
    bool ok = true;  // every rank computed its partial (and `local` is ok)
    double sum_squares = 0;
  };
  Result<GlobalNorm> global_norm(Status& local) {
    GlobalNorm norm;
    if (e.s.gradient_clipping > 0 || scaler.checks_overflow()) {
      const float factor = optimizer.combined_scale();
      if (e.policy.owns_every_shard) {
        // Every rank holds every shard: compute each rank's partial exactly as that rank would.
        for (int r = 0; r < e.world && local.is_ok(); ++r) {
          auto p = optimizer.partial_sum_squares(r, factor);
          if (p.is_ok()) {
            norm.sum_squares += *p;
          } else {
            local = p.status();
          }
        }
      } else {
        double mine = engine_detail::StepAgreement::kFailed;
        if (local.is_ok()) {
          auto p = optimizer.partial_sum_squares(e.rank, factor);
          if (p.is_ok()) {
            mine = *p;
          } else {
            local = p.status();
          }
        }
        ZINF_ASSIGN_OR_RETURN(std::vector<double> all, agreement.exchange_partials(mine));
        for (double p : all) {
          norm.ok &= !(p < 0);  // the failure sentinel (an overflow's NaN or inf is not one)
          norm.sum_squares += p;
        }
      }
    }
    norm.ok &= local.is_ok();
    return norm;
  }

  // Global-norm clipping: the factor the gradients are multiplied by (1 when not clipped).
  float clip_coef(double grad_norm) const {
    if (e.s.gradient_clipping <= 0 || grad_norm <= e.s.gradient_clipping) return 1.0f;
    return static_cast<float>(e.s.gradient_clipping / (grad_norm + 1e-6));
  }

  // fp16 overflow on some rank: no update; the loss scale goes down.
  void skip(StepInfo& info) {
    info.skipped = true;
    scaler.on_overflow();
    optimizer.discard();
    info.loss_scale = scaler.scale();
    info.step = e.steps;
  }

  // Updated on every rank: the next step starts from here.
  Status commit(StepInfo& info) {
    ++e.steps;
    optimizer.commit();
    Status shared;
    if (e.policy.share_updated_params) shared = gatherer.share_updated_parameters();
    scaler.on_good_step();
    info.step = e.steps;
    info.loss_scale = scaler.scale();
    Status end = e.finish_evictions();
    return shared.is_ok() ? end : shared;
  }
};

// ---- UnitScope ----------------------------------------------------------------------------------

UnitScope& UnitScope::operator=(UnitScope&& o) noexcept {
  if (this != &o) {
    if (engine_) (void)finish();
    engine_ = std::exchange(o.engine_, nullptr);
    unit_ = o.unit_;
    params_ = std::exchange(o.params_, nullptr);
    param_handle_ = std::move(o.param_handle_);
    grads_ = std::move(o.grads_);
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
  if (engine_ == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "params_to_host() of a scope that has ended");
  }
  const auto& l = layout();
  if (out.size() < l.numel) {
    return make_error(ErrorCode::kInvalidArgument,
                      "params_to_host: unit {} has {} parameters, the buffer holds {}",
                      engine_->unit_spec(unit_).name, l.numel, out.size());
  }
  Stream& stream = engine_->stream();
  engine_->device().cast({.data = out.data(), .dtype = DType::kF32, .numel = l.numel},
                         {params_, engine_->settings_.dtype, l.numel}, stream);
  return engine_detail::sync(stream).with_context("reading the parameters of unit " +
                                                  engine_->unit_spec(unit_).name);
}

Status UnitScope::grads_from_host(std::span<const float> in) {
  ZINF_ASSIGN_OR_RETURN(TensorView g, grads());
  const auto& l = layout();
  if (in.size() != l.numel) {
    return make_error(ErrorCode::kInvalidArgument,
                      "grads_from_host: unit {} has {} parameters, got {} gradients",
                      engine_->unit_spec(unit_).name, l.numel, in.size());
  }
  Stream& stream = engine_->stream();
  TensorRef dst = g.ref();
  dst.numel = l.numel;  // the padding stays zero
  engine_->device().cast(dst, {in.data(), DType::kF32, l.numel}, stream);
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
  (void)impl_->reducer.drain();
  (void)impl_->optimizer.wait_early();
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
  ZINF_ASSIGN_OR_RETURN(scope.params_, impl_->gatherer.begin_use(unit, scope.param_handle_));
  scope.engine_ = this;  // from here on the scope's end undoes the use
  return scope;
}

Result<TensorView> Engine::scope_grads(UnitScope& scope) {
  engine_detail::EngineState& e = impl_->e;
  const auto& l = e.unit_states[scope.unit_].layout;
  const std::string& name = e.units[scope.unit_].name;
  if (!scope.grads_) {
    ZINF_ASSIGN_OR_RETURN(
        DeviceBuffer g,
        e.store->allocate_device(l.numel_padded * dtype_size(e.s.dtype), MemoryCategory::kGradients,
                                 "gradient buffer of " + name));
    e.device->fill({.data = g.data(), .dtype = DType::kF32, .numel = g.bytes() / 4}, 0.0f,
                   *e.stream);
    ZINF_RETURN_IF_ERROR(
        engine_detail::sync(*e.stream).with_context("zeroing the gradient buffer of " + name));
    scope.grads_ = std::move(g);
  }
  return TensorView(scope.grads_.data(), e.s.dtype, l.numel_padded,
                    "the gradients of unit " + name);
}

Status Engine::end_scope(UnitScope& scope) {
  engine_detail::EngineState& e = impl_->e;
  // The model's own operations on the scope's buffers (on stream()) finish before the gradients
  // are reduced and the gathered parameters are let go.
  Status ops = engine_detail::sync(*e.stream);
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

float Engine::loss_scale() const { return impl_->scaler.scale(); }

Device& Engine::device() const { return *impl_->e.device; }
Stream& Engine::stream() const { return *impl_->e.stream; }
const Budgets& Engine::budgets() const { return impl_->e.budgets; }

StoreStats Engine::store_stats() const { return impl_->e.store->stats(); }

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
  ZINF_RETURN_IF_ERROR(impl_->reducer.drain());
  ZINF_RETURN_IF_ERROR(impl_->optimizer.wait_early());
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

size_t Engine::unit_count() const { return impl_->e.unit_states.size(); }
const zero::ShardLayout& Engine::layout(size_t unit) const {
  return impl_->e.unit_states.at(unit).layout;
}
const zero::UnitSpec& Engine::unit_spec(size_t unit) const { return impl_->e.units.at(unit); }
int Engine::rank() const { return impl_->e.rank; }
int Engine::world_size() const { return impl_->e.world; }

}  // namespace zinf
