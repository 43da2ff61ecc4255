#include "builder.h"

#include <algorithm>
#include <cstring>

#include "state_sizes.h"
#include "zinf/core/units.h"
#include "zinf/core/validate.h"
#include "zinf/engine/budgets.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/sched/sub_groups.h"

namespace zinf::engine_detail {
namespace {

class Builder {
 public:
  Builder(EngineState& state, OptimizerPipeline& pipeline) : e(state), optimizer(pipeline) {}

  // The rules of zinf/core/validate.h that apply to EngineSettings.
  Status validate() const {
    const EngineSettings& s = e.s;
    ZINF_RETURN_IF_ERROR(validate::stage(s.stage));
    ZINF_RETURN_IF_ERROR(validate::offload_stage(validate::Offloaded::kParams,
                                                 EngineSettings::home_name(s.param_home), s.stage));
    for (auto [what, home] : {std::pair{validate::Offloaded::kParams, s.param_home},
                              {validate::Offloaded::kOptimizer, s.optimizer_home}}) {
      ZINF_RETURN_IF_ERROR(
          validate::nvme_path_given(what, EngineSettings::home_name(home), s.nvme_paths.size()));
    }
    ZINF_RETURN_IF_ERROR(validate::positive(
        *tunables::find(tunables::kGradientAccumulationSteps.name), s.gradient_accumulation_steps));
    return validate::optimizer_offload_ratio(s.optimizer_offload_ratio);
  }

  // Resolves automatic budgets (device_mem / host_mem 0) into e.s from the model's sizes and the
  // machine (zinf/engine/budgets.h); explicit ones are kept. Every rank then takes the smallest
  // of the ranks' budgets: the scheduler's decisions depend on the device budget, and every rank
  // must issue the same all-gathers (MemAvailable differs between ranks and over time).
  Status choose_budgets_for(const std::vector<zero::ShardLayout>& layouts,
                            const std::vector<Tier>& opt_homes) {
    const EngineSettings& s = e.s;
    const StateSizes z = measure_state(s, e.policy, layouts, opt_homes, e.world);
    e.staging_total = z.staging_bytes;
    MachineMemory machine{.total_bytes = uint64_t{1} << 40, .available_bytes = uint64_t{1} << 40};
    if (s.device_mem == 0 || s.host_mem == 0) {
      ZINF_ASSIGN_OR_RETURN(machine, read_machine_memory());
    }
    e.sizes = z;
    const bool local = e.comm.backend() == comm::Backend::kLocal;
    const int ranks_here = ranks_on_this_machine(local, e.world);
    ZINF_ASSIGN_OR_RETURN(const DeviceKind kind, resolve_device_kind(s.device));
    if (kind == DeviceKind::kCuda && s.device_mem == 0 && cuda_device_count() > 0) {
      const int ordinal = cuda_ordinal(s.device_ordinal);
      machine.device_free_bytes = cuda_free_bytes(ordinal);
      machine.ranks_per_device = (ranks_here + cuda_device_count() - 1) / cuda_device_count();
    }
    e.budgets = choose_budgets(s, z, machine, ranks_here);
    if (e.world > 1) {
      ZINF_ASSIGN_OR_RETURN(e.budgets.device_bytes, smallest_of_ranks(e.budgets.device_bytes));
      ZINF_ASSIGN_OR_RETURN(e.budgets.host_bytes, smallest_of_ranks(e.budgets.host_bytes));
    }
    e.s.device_mem = e.budgets.device_bytes;
    e.s.host_mem = e.budgets.host_bytes;
    return check_budgets_fit(z);
  }

  // The reductions a step keeps in flight follow from the agreed budget (the same on every
  // rank); a budget that cannot hold one unit's working set is refused here, before anything is
  // allocated, rather than failing mid-step.
  Status check_budgets_fit(const StateSizes& z) {
    const EngineSettings& s = e.s;
    e.max_reductions_in_flight = reductions_that_fit(z, s.dtype, e.s.device_mem, s.overlap_comm);
    if (e.max_reductions_in_flight < 0) {
      const uint64_t need = device_minimum_bytes(z, s.dtype, 0);
      return make_error(
          ErrorCode::kInvalidArgument,
          "device budget {} is too small: this model and placement need at least {} per rank on "
          "the device ({} of state homed there, {} of persistent parameters and as much for "
          "their gradients, and the largest unit of {} parameters gathered with its gradient)",
          format_bytes(static_cast<double>(e.s.device_mem)),
          format_bytes(static_cast<double>(need)),
          format_bytes(static_cast<double>(z.device_home_bytes)),
          format_bytes(static_cast<double>(z.persistent_elements * dtype_size(s.dtype))),
          z.largest_unit_elements);
    }
    // The host budget likewise: its staging buffers, the state homed there and, with the
    // optimizer offloaded, the two parameter tensors its update holds (the one it updates and the
    // next, read ahead: StateSizes::cpu_update_bytes) must fit, or a step fails midway.
    const uint64_t host_need = z.host_home_bytes + z.staging_bytes + z.cpu_update_bytes;
    if (e.s.host_mem < host_need) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "host budget {} is too small: this model and placement need at least {} per rank in "
          "host memory ({} of staging buffers, {} of state homed there{})",
          format_bytes(static_cast<double>(e.s.host_mem)),
          format_bytes(static_cast<double>(host_need)),
          format_bytes(static_cast<double>(z.staging_bytes)),
          format_bytes(static_cast<double>(z.host_home_bytes)),
          z.cpu_update_bytes > 0
              ? fmt::format(", and two parameter tensors ({} each) for the CPU optimizer's update",
                            format_bytes(static_cast<double>(z.cpu_update_bytes / 2)))
              : std::string());
    }
    return Status::ok();
  }

  // The smallest of every rank's `value`.
  Result<uint64_t> smallest_of_ranks(uint64_t value) {
    std::vector<uint64_t> all(e.world);
    ZINF_RETURN_IF_ERROR(e.comm.all_gather_bytes(&value, all.data(), sizeof value).wait());
    return *std::min_element(all.begin(), all.end());
  }

  // This rank's resources: device and streams, NVMe swap, pinned host pool, the store over them.
  Status open_tiers(bool nvme) {
    const EngineSettings& s = e.s;
    ZINF_ASSIGN_OR_RETURN(const DeviceKind kind, resolve_device_kind(s.device));
    ZINF_ASSIGN_OR_RETURN(e.device, make_device(kind, {.budget_bytes = s.device_mem,
                                                       .ledger = &e.ledger,
                                                       .threads = s.optimizer_threads,
                                                       .ordinal = s.device_ordinal}));
    e.stream = e.device->create_stream(e.track("engine"));
    e.optimizer_stream = e.device->create_stream(e.track("optimizer"));
    if (nvme) {
      ZINF_ASSIGN_OR_RETURN(e.io, io::IoEngine::create({.queue_depth = s.io_queue_depth,
                                                        .block_size = s.io_block_size,
                                                        .rings = s.io_rings,
                                                        .fixed_buffers = s.io_fixed_buffers,
                                                        .single_submit = s.io_single_submit}));
      ZINF_ASSIGN_OR_RETURN(e.swap, io::SwapSpace::create(*e.io, {.directories = s.nvme_paths,
                                                                  .checksum = s.checksum}));
    }
    e.pool = std::make_unique<PinnedPool>(PinnedPoolOptions{.budget_bytes = s.host_mem,
                                                            .pin = s.pin_memory,
                                                            .engine = e.io.get(),
                                                            .ledger = &e.ledger,
                                                            .device = e.device.get()});
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
    const std::vector<Tier> opt_homes = optimizer_homes(s, layouts);
    ZINF_RETURN_IF_ERROR(choose_budgets_for(layouts, opt_homes));
    ZINF_RETURN_IF_ERROR(open_tiers(nvme));

    // The scheduler: its live bound is also held to what fits in the device budget beside the
    // homed state and the unit being worked on (the same on every rank: it depends on the sizes
    // and the budget, never on memory pressure).
    std::vector<uint64_t> unit_elements;
    for (const auto& l : layouts) unit_elements.push_back(l.numel_padded);
    e.sched = std::make_unique<sched::Scheduler>(
        sched::SchedulerOptions{
            .prefetch_elements = s.prefetch_bucket_elements,
            .max_live_elements = std::min(
                s.max_live_elements,
                live_elements_that_fit(e.sizes, s.dtype, s.device_mem, e.max_reductions_in_flight)),
            .max_reuse_distance = s.max_reuse_distance,
            .reads_in_live_room = e.world == 1},
        unit_elements);
    uint64_t total_unit_elements = 0;
    for (uint64_t n : unit_elements) total_unit_elements += n;
    e.updates = UpdatePolicy::decide(s, e.policy, e.world,
                                     e.sched->options().max_live_elements >= total_unit_elements);

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

 private:
  EngineState& e;
  OptimizerPipeline& optimizer;
};

}  // namespace

Status build_engine(EngineState& e, OptimizerPipeline& optimizer) {
  return Builder(e, optimizer).build();
}

}  // namespace zinf::engine_detail
