#include "zinf/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "loss_scaler.h"
#include "stage_policy.h"
#include "step_agreement.h"
#include "zinf/core/log.h"
#include "zinf/core/trace.h"
#include "zinf/core/units.h"
#include "zinf/engine/budgets.h"
#include "zinf/io/io_engine.h"
#include "zinf/io/swap_space.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/pinned_pool.h"
#include "zinf/sched/scheduler.h"
#include "zinf/sched/sub_groups.h"

namespace zinf {
namespace {

constexpr uint32_t kStoreMovers = 2;  // the store's mover threads (each has a staging lane)
constexpr TensorId kNoTensor = ~TensorId{0};

// Waits for the operations enqueued on `stream` so far; their first failure (cleared from the
// stream, so that it is reported once).
Status sync(Stream& stream) {
  Status st = stream.record().wait();
  if (!st.is_ok()) (void)stream.synchronize();
  return st;
}

}  // namespace

// Runs optimizer updates on one thread of its own, in submission order (overlap_optimizer).
class OptimizerWorker {
 public:
  OptimizerWorker() : thread_([this] { run(); }) {}
  ~OptimizerWorker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void submit(std::function<Status()> job) {
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  // Waits until every submitted job has run; the first failure since the last wait.
  Status wait() {
    std::unique_lock lk(mu_);
    idle_cv_.wait(lk, [&] { return jobs_.empty() && !busy_; });
    return std::exchange(first_error_, Status());
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lk.unlock();
      Status st = job();
      lk.lock();
      busy_ = false;
      if (!st.is_ok() && first_error_.is_ok()) first_error_ = std::move(st);
      if (jobs_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> jobs_;
  bool busy_ = false, stop_ = false;
  Status first_error_;
  std::thread thread_;
};

struct Engine::Impl {
  EngineSettings s;
  comm::Communicator& comm;
  engine_detail::StagePolicy policy;  // what the stage partitions (the only reader of s.stage)
  std::vector<zero::UnitSpec> units;
  InitFn init;
  int rank = 0, world = 1;
  bool mixed = false;  // working dtype is not fp32: a separate fp32 master exists

  Ledger ledger;
  Budgets budgets;                   // how device_mem and host_mem were chosen
  uint64_t staging_total = 0;        // the store's staging buffers, taken from the host budget
  uint64_t largest_param_bytes = 0;  // this rank's largest parameter tensor (shard or unit)
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<Device> device;
  // The engine's device operations, in order: `stream` for the gathering, reduction and norm
  // path (the calling thread), `optimizer_stream` for updates (step(), or the optimizer worker
  // under overlap_optimizer; never both at once).
  std::unique_ptr<Stream> stream, optimizer_stream;
  std::vector<char> host_scratch;  // reduced gradients on their way to a host-tier accumulator
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<TieredTensorStore> store;

  struct UnitState {
    zero::ShardLayout layout;
    TensorId params = kNoTensor;  // working dtype: full (stages 0-2) or shard (stage 3)
    std::vector<size_t> pieces;   // its optimizer state, in range order (indices into `pieces`)
    // The accumulators hold zeros in this rank's range (without their bytes having been written:
    // zeroing is lazy, so an offloaded accumulator is not read and written just to clear it).
    bool acc_zero = true;
    Tier opt_home = Tier::kDevice;  // the optimizer's home for this unit (partial offload)
    // Stage 3, units of at most stage3_param_persistence_threshold elements: once gathered in a
    // step they stay gathered until the update.
    bool persistent = false;
    // Stage 3: the gathered full parameters while the unit is live (in use, fetched ahead or
    // kept); the all-gather filling them may still be in flight, its shard pinned until done.
    DeviceBuffer gathered;
    TensorHandle gathering_shard;
    std::vector<Device::CommWindow> gather_windows;  // the all-gather's reach into the device
    comm::Work gather_work;
    bool gather_in_flight = false;
    trace::Clock::time_point gather_issued;
    int scopes = 0;                  // open scopes on the unit (stage 3: using `gathered`)
    bool used_since_gather = false;  // for the schedule report
    // The unit's gradients are final for this step: its last use in the recorded order has been
    // reduced (known only while the step follows the trace).
    bool grads_final = false;
    // overlap_optimizer: its final reduction of the step was issued and its update goes to the
    // optimizer worker once the reduction completes; the unit must not be used again this step.
    bool final_issued = false;
  };
  std::vector<UnitState> unit_states;

  // A piece of one unit's optimizer state: the flat elements [begin, end) of the unit.
  struct PieceState {
    size_t unit = 0;
    uint64_t begin = 0, end = 0;
    TensorId master = kNoTensor;            // fp32 master when mixed
    TensorId m = kNoTensor, v = kNoTensor;  // fp32 Adam moments
    // The fp32 gradient accumulator holding [begin, end): the piece's own, or (stage 1, whose
    // ranks hold full gradients) the unit's one full accumulator, shared by its pieces.
    TensorId acc = kNoTensor;
    uint64_t acc_base = 0;  // flat index of the accumulator's element 0
    bool owns_acc = true;   // false for a shared accumulator
  };
  std::vector<PieceState> pieces;
  std::vector<std::vector<size_t>> groups;  // sub-groups of pieces, in declaration order
  // The order step() walks the groups in: the order in which their gradients become final in
  // the recorded trace (the backward order), so that the first groups' state can be read while
  // the backward pass still runs. Declaration order until a trace is recorded.
  std::vector<size_t> walk;
  size_t walk_prefetched = 0;  // groups of `walk` whose state was read ahead during backward
  static constexpr size_t kGroupsReadDuringBackward = 2;
  // Whether those reads fit beside the gradient accumulators the backward pass fills: when they
  // do not, the host budget would evict the (clean) state just read, and it would be read twice.
  bool read_during_backward = false;

  // Reductions issued at scope end, accumulated when they complete (in issue order).
  struct Pending {
    size_t unit;
    DeviceBuffer grads;  // the full gradient buffer (reduced in place for stage 0)
    DeviceBuffer shard;  // stages 1-3: this rank's reduced part
    std::vector<comm::Work> works;
    std::vector<Device::CommWindow> windows;  // the reductions' reach into grads and shard
    bool final = false;                       // the unit's last gradient of the step
  };
  std::deque<Pending> pending;
  Status sticky;  // an error from a scope's destructor, reported by the next call
  // Pieces whose update of the step being made is done (early on the worker, or in step()).
  // Cleared when the step is committed on every rank; a step() that fails keeps it, and the
  // next step() finishes the update without repeating what was done.
  std::vector<uint8_t> updated;
  bool update_incomplete = false;  // the last step() failed: the next call must finish it

  std::unique_ptr<sched::Scheduler> sched;
  ScheduleReport schedule_now;  // counts since the last step
  std::mutex evictions_mu;
  std::vector<std::shared_future<Status>> evictions;  // write-backs in flight
  std::unique_ptr<OptimizerWorker> worker;            // overlap_optimizer only
  size_t updated_early = 0;                           // units handed to the worker in this step

  // Step state.
  int64_t steps = 0;
  CommReport comm_now;  // counts since the last step
  engine_detail::LossScaler scaler;
  engine_detail::StepAgreement agreement;  // counts into comm_now.control_elements

  Impl(const EngineSettings& settings, comm::Communicator& c)
      : s(settings),
        comm(c),
        policy(engine_detail::StagePolicy::for_stage(settings.stage)),
        scaler(settings),
        agreement(c, comm_now.control_elements) {}

  // "rank<r> <what>": this rank's track in a trace.
  std::string track(const char* what) const {
    return *what ? fmt::format("rank{} {}", rank, what) : fmt::format("rank{}", rank);
  }

  // Where a unit's optimizer update runs: on the device, or on the CPU for state offloaded to
  // host memory or NVMe.
  Tier compute_tier(const UnitState& st) const {
    return st.opt_home == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  }
  // Index of flat element `flat` in the unit's parameter tensor.
  uint64_t param_index(const UnitState& u, uint64_t flat) const {
    return policy.param_index(u.layout, rank, flat);
  }
  Result<TensorId> make_tensor(const std::string& name, uint64_t bytes, Tier home,
                               MemoryCategory category) {
    return store->create_tensor(
        TensorSpec{.name = name, .bytes = bytes, .home = home, .category = category});
  }

  // The sub-group size in elements: the configured one, and with the optimizer offloaded under a
  // host budget at most a third of what the budget holds (three groups are in flight at once:
  // one being read, one updated, one written back).
  uint64_t sub_group_limit() const {
    uint64_t limit = s.sub_group_elements;
    if (limit == 0 || s.optimizer_home == Tier::kDevice) return limit;
    // Per element of a group: fp32 master (mixed), m, v and gradient accumulator. A unit's
    // parameter tensor is acquired whole for its pieces' updates: two of the largest (the one
    // being updated, the next read ahead) and the staging buffers come off the budget first.
    const uint64_t bytes_per_element = mixed ? 16 : 12;
    const uint64_t reserved = staging_total + 2 * largest_param_bytes;
    const uint64_t fit = (s.host_mem - std::min(s.host_mem, reserved)) / (3 * bytes_per_element);
    return std::min(limit, std::max(fit / kernels::kSumSquaresBlockElems, uint64_t{1}) *
                               kernels::kSumSquaresBlockElems);
  }

  // Resolves automatic budgets (device_mem / host_mem 0) into `s` from the model's sizes and the
  // machine (zinf/engine/budgets.h); explicit ones are kept.
  Status choose_budgets_for(const std::vector<zero::ShardLayout>& layouts, bool nvme) {
    const uint64_t wsize = dtype_size(s.dtype);
    staging_total = nvme ? uint64_t{kStoreMovers + 1} * std::max<uint32_t>(s.staging_buffers, 2) *
                               s.staging_bytes
                         : 0;
    StateSizes z{.staging_bytes = staging_total,
                 .optimizer_offloaded = s.optimizer_home != Tier::kDevice,
                 .world = world,
                 .nvme = nvme,
                 .params_offloaded = s.param_home != Tier::kDevice};
    uint64_t opt_bytes = 0;
    for (const auto& l : layouts) {
      z.largest_unit_elements = std::max(z.largest_unit_elements, l.numel_padded);
      z.total_unit_elements += l.numel_padded;
      const uint64_t params = policy.param_elements(l) * wsize;
      largest_param_bytes = std::max(largest_param_bytes, params);
      if (s.param_home == Tier::kDevice) z.device_home_bytes += params;
      if (s.param_home == Tier::kHost) z.host_home_bytes += params;
      // fp32 m, v, gradient accumulator (and master when mixed) of the elements this rank owns.
      opt_bytes += policy.owned_elements(l) * (mixed ? 12 : 8) + policy.accumulator_elements(l) * 4;
    }
    const double offloaded = s.optimizer_home == Tier::kDevice ? 0 : s.optimizer_offload_ratio;
    z.device_home_bytes += static_cast<uint64_t>(static_cast<double>(opt_bytes) * (1 - offloaded));
    if (s.optimizer_home == Tier::kHost) {
      z.host_home_bytes += static_cast<uint64_t>(static_cast<double>(opt_bytes) * offloaded);
    }
    z.largest_param_bytes = largest_param_bytes;
    MachineMemory machine{.total_bytes = uint64_t{1} << 40, .available_bytes = uint64_t{1} << 40};
    if (s.device_mem == 0 || s.host_mem == 0) {
      ZINF_ASSIGN_OR_RETURN(machine, read_machine_memory());
    }
    budgets = choose_budgets(s, z, machine,
                             ranks_on_this_machine(comm.backend() == comm::Backend::kLocal, world));
    s.device_mem = budgets.device_bytes;
    s.host_mem = budgets.host_bytes;
    return Status::ok();
  }

  Status build() {
    rank = comm.rank();
    world = comm.world_size();
    mixed = s.dtype != DType::kF32;
    if (s.stage < 0 || s.stage > 3) {
      return make_error(ErrorCode::kInvalidArgument, "ZeRO stage must be 0..3, got {}", s.stage);
    }
    if (s.param_home != Tier::kDevice && !policy.sharded_params) {
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
    const uint64_t wsize = dtype_size(s.dtype);
    uint64_t total_numel = 0, offloaded_numel = 0;
    std::vector<zero::ShardLayout> layouts;
    for (const auto& unit : units) {
      ZINF_ASSIGN_OR_RETURN(zero::ShardLayout l, zero::make_shard_layout(unit, world, s.dtype));
      total_numel += l.numel;
      layouts.push_back(std::move(l));
    }
    bool nvme = s.param_home == Tier::kNvme || s.optimizer_home == Tier::kNvme;
    ZINF_RETURN_IF_ERROR(choose_budgets_for(layouts, nvme));

    // Resources of this rank: device, pinned host pool, NVMe swap, the store over them.
    ZINF_ASSIGN_OR_RETURN(const DeviceKind kind, resolve_device_kind(s.device));
    device = make_cpu_device({.budget_bytes = s.device_mem,
                              .ledger = &ledger,
                              .strict = kind == DeviceKind::kCpuStrict,
                              .threads = s.optimizer_threads});
    stream = device->create_stream(track("engine"));
    optimizer_stream = device->create_stream(track("optimizer"));
    if (nvme) {
      ZINF_ASSIGN_OR_RETURN(io, io::IoEngine::create({.queue_depth = s.io_queue_depth,
                                                      .block_size = s.io_block_size,
                                                      .rings = s.io_rings,
                                                      .single_submit = s.io_single_submit}));
      std::vector<std::string> dirs = s.nvme_paths;
      ZINF_ASSIGN_OR_RETURN(
          swap, io::SwapSpace::create(*io, {.directories = dirs, .checksum = s.checksum}));
    }
    pool = std::make_unique<PinnedPool>(PinnedPoolOptions{
        .budget_bytes = s.host_mem, .pin = s.pin_memory, .engine = io.get(), .ledger = &ledger});
    ZINF_ASSIGN_OR_RETURN(store, TieredTensorStore::create({.device = device.get(),
                                                            .host = pool.get(),
                                                            .swap = swap.get(),
                                                            .ledger = &ledger,
                                                            .staging_bytes = s.staging_bytes,
                                                            .staging_buffers = s.staging_buffers,
                                                            .movers = kStoreMovers,
                                                            .trace_name = track("")}));

    // The scheduler: its live bound is also held to half the device budget (the same on every
    // rank: it never depends on memory pressure).
    std::vector<uint64_t> unit_elements;
    for (const auto& l : layouts) unit_elements.push_back(l.numel_padded);
    sched::SchedulerOptions so{.prefetch_elements = s.prefetch_bucket_elements,
                               .max_live_elements = s.max_live_elements,
                               .max_reuse_distance = s.max_reuse_distance};
    so.max_live_elements = std::min(so.max_live_elements, s.device_mem / 2 / wsize);
    sched = std::make_unique<sched::Scheduler>(so, unit_elements);
    // Optimizer sub-groups over the ranges this rank owns.
    std::vector<std::vector<sched::ElementRange>> owned;
    for (const auto& l : layouts) owned.push_back(policy.owned_ranges(l, rank, world));
    const sched::SubGroupPlan plan =
        sched::plan_sub_groups(owned, sub_group_limit(), kernels::kSumSquaresBlockElems);
    groups = plan.groups;
    updated.assign(plan.pieces.size(), 0);
    for (size_t g = 0; g < groups.size(); ++g) walk.push_back(g);
    schedule_now.sub_groups = groups.size();
    if (s.overlap_optimizer) {
      worker = std::make_unique<OptimizerWorker>();
      if (!can_update_early()) {
        log::warn_once("engine:overlap-optimizer",
                       "overlap_optimizer has no effect with gradient clipping or fp16: the "
                       "update needs every gradient (the global norm, the overflow check) first");
      }
    }

    uint64_t acc_bytes = 0, largest_group = 0;  // offloaded accumulators; elements
    for (const auto& g : groups) {
      uint64_t n = 0;
      for (size_t pi : g) n += plan.pieces[pi].range.size();
      largest_group = std::max(largest_group, n);
    }
    for (size_t u = 0; u < units.size(); ++u) {
      UnitState st;
      st.layout = layouts[u];
      st.persistent = policy.sharded_params && st.layout.numel <= s.param_persistence_threshold;
      // Partial offload (DeepSpeed's Twin-Flow `ratio`): the first units, in declaration order,
      // holding about `ratio` of the parameters have their optimizer state offloaded; the others
      // keep it on the device and are updated there.
      if (s.optimizer_home != Tier::kDevice &&
          static_cast<double>(offloaded_numel) + st.layout.numel / 2.0 <=
              s.optimizer_offload_ratio * static_cast<double>(total_numel)) {
        st.opt_home = s.optimizer_home;
        offloaded_numel += st.layout.numel;
      }
      const std::string& name = units[u].name;
      ZINF_ASSIGN_OR_RETURN(st.params,
                            make_tensor(name + ".params", policy.param_elements(st.layout) * wsize,
                                        s.param_home, MemoryCategory::kParameters));
      // Stage 1 ranks hold full gradients: one accumulator for the unit, shared by its pieces.
      TensorId shared_acc = kNoTensor;
      if (policy.full_grad_accumulator) {
        ZINF_ASSIGN_OR_RETURN(
            shared_acc, make_tensor(name + ".grad_acc", policy.accumulator_elements(st.layout) * 4,
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
        if (mixed) {
          ZINF_ASSIGN_OR_RETURN(p.master, make_tensor(tensor_name("master"), n * 4, st.opt_home,
                                                      MemoryCategory::kOptimizerStates));
        }
        ZINF_ASSIGN_OR_RETURN(p.m, make_tensor(tensor_name("adam_m"), n * 4, st.opt_home,
                                               MemoryCategory::kOptimizerStates));
        ZINF_ASSIGN_OR_RETURN(p.v, make_tensor(tensor_name("adam_v"), n * 4, st.opt_home,
                                               MemoryCategory::kOptimizerStates));
        // The fp32 gradient lives with the optimizer state (device, host or NVMe), so that with
        // NVMe offload no training state is bound to memory (the host budget caches it).
        if (shared_acc != kNoTensor) {
          p.acc = shared_acc;
          p.acc_base = 0;
          p.owns_acc = false;
        } else {
          ZINF_ASSIGN_OR_RETURN(p.acc, make_tensor(tensor_name("grad_acc"), n * 4, st.opt_home,
                                                   MemoryCategory::kGradients));
          p.acc_base = p.begin;
        }
        // Pieces are made in plan order, so indices into `pieces` match the plan's.
        st.pieces.push_back(pieces.size());
        pieces.push_back(p);
      }
      if (st.opt_home != Tier::kDevice) {
        acc_bytes += policy.accumulator_elements(st.layout) * 4;
      }
      unit_states.push_back(std::move(st));
      ZINF_RETURN_IF_ERROR(initialise(u));
    }
    // Per element read ahead: m, v, the fp32 master (mixed) and the stage-3 parameter shard.
    const uint64_t read_per_element = (mixed ? 12 : 8) + (policy.sharded_params ? wsize : 0);
    read_during_backward =
        s.pipeline_read &&
        acc_bytes + kGroupsReadDuringBackward * largest_group * read_per_element + staging_total <=
            s.host_mem;
    return Status::ok();
  }

  // Fills the parameters this rank holds (and its fp32 master) from the init function.
  Status initialise(size_t u) {
    UnitState& st = unit_states[u];
    const auto& l = st.layout;
    const uint64_t p_begin = policy.param_begin(l, rank);
    const uint64_t p_end = p_begin + policy.param_elements(l);
    // fp32 values of [begin, end) of the unit (zero past numel: the padding).
    auto values = [&](uint64_t begin, uint64_t end) {
      std::vector<float> out(end - begin);
      for (uint64_t flat = begin; flat < std::min(end, l.numel); ++flat) {
        out[flat - begin] = init(u, flat, s.seed);
      }
      return out;
    };
    {  // written on the host, converted to the working dtype there
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, store->acquire(st.params, Tier::kHost));
      const std::vector<float> v = values(p_begin, p_end);
      kernels::cast(v.data(), DType::kF32, h.data(), s.dtype, v.size(), s.optimizer_threads);
      h.mark_dirty();
    }
    if (mixed) {
      for (size_t pi : st.pieces) {
        const PieceState& p = pieces[pi];
        {
          ZINF_ASSIGN_OR_RETURN(TensorHandle h, store->acquire(p.master, Tier::kHost));
          const std::vector<float> v = values(p.begin, p.end);
          std::memcpy(h.data(), v.data(), v.size() * 4);
          h.mark_dirty();
        }
        if (st.opt_home != Tier::kHost) {
          ZINF_RETURN_IF_ERROR(store->flush(p.master));
          if (st.opt_home == Tier::kNvme) ZINF_RETURN_IF_ERROR(store->evict(p.master, Tier::kHost));
        }
      }
    }
    // Resident where they are used; the host copy written above is not kept.
    if (s.param_home != Tier::kHost) {
      { ZINF_ASSIGN_OR_RETURN(TensorHandle d, store->acquire(st.params, Tier::kDevice)); }
      ZINF_RETURN_IF_ERROR(store->evict(st.params, Tier::kHost));
    }
    return Status::ok();
  }

  // ---- the schedule: uses, gathers ahead, kept units -----------------------------------------

  // Called at each gather, before anything is fetched.
  Status on_use(size_t u) {
    if (update_incomplete) {
      return make_error(ErrorCode::kInvalidArgument,
                        "the last step() failed (its gradients are still pending and part of the "
                        "optimizer state may be updated); call step() again to finish it before "
                        "using unit {}",
                        units[u].name);
    }
    if (unit_states[u].final_issued) {
      return make_error(ErrorCode::kInvalidArgument,
                        "unit {} is used again after its optimizer update started in this step "
                        "(overlap_optimizer needs every step to use the units in the recorded "
                        "order)",
                        units[u].name);
    }
    const size_t at = sched->position();
    if (sched->on_use(u) == sched::Use::kDeparted) {
      log::warn_once("engine:trace",
                     fmt::format("use {} of the step (unit {}) differs from the recorded order; "
                                 "re-recording it (prefetching resumes after this step; reported "
                                 "once)",
                                 at, units[u].name));
    }
    return Status::ok();
  }

  // Stage 3: starts all-gathering unit u's parameters into a new device buffer (u becomes live).
  Status start_gather(size_t u) {
    UnitState& st = unit_states[u];
    const uint64_t wsize = dtype_size(s.dtype);
    ZINF_ASSIGN_OR_RETURN(TensorHandle shard, store->acquire(st.params, Tier::kDevice));
    ZINF_ASSIGN_OR_RETURN(
        DeviceBuffer full,
        store->allocate_device(st.layout.numel_padded * wsize, MemoryCategory::kParameters,
                               "gathered parameters of " + units[u].name));
    st.gather_issued = trace::Clock::now();
    st.gather_windows.push_back(device->comm_window(shard.data(), st.layout.shard_numel * wsize));
    st.gather_windows.push_back(device->comm_window(full.data(), full.bytes()));
    st.gather_work = comm.all_gather(shard.data(), full.data(), st.layout.shard_numel, s.dtype);
    st.gather_in_flight = true;
    st.used_since_gather = false;
    st.gathering_shard = std::move(shard);
    st.gathered = std::move(full);
    comm_now.param_gather_elements += st.layout.numel_padded;
    sched->set_live(u, true);
    schedule_now.peak_live_elements =
        std::max(schedule_now.peak_live_elements, sched->live_elements());
    return Status::ok();
  }

  // Waits for unit u's all-gather (if in flight) and lets its shard go.
  Status finish_gather(size_t u) {
    UnitState& st = unit_states[u];
    if (!st.gather_in_flight) return Status::ok();
    Status ws = st.gather_work.wait();
    if (trace::enabled()) {
      trace::complete(track("comm"), "all-gather " + units[u].name, st.gather_issued);
    }
    st.gather_in_flight = false;
    st.gather_work = comm::Work();
    st.gather_windows.clear();
    st.gathering_shard.release();
    release_offloaded(st.params, s.param_home, Tier::kDevice);
    if (!ws.is_ok()) {
      drop_live(u);
      return std::move(ws).with_context("gathering unit " + units[u].name);
    }
    return Status::ok();
  }

  // Unit u is no longer live: its gathered parameters are freed (after its all-gather, which
  // owns the buffer until it completes).
  void drop_live(size_t u) {
    UnitState& st = unit_states[u];
    if (st.gather_in_flight) {
      Status ws = finish_gather(u);  // (which drops the unit itself when it failed)
      if (!ws.is_ok() && sticky.is_ok()) sticky = std::move(ws);
    }
    st.gathered.reset();
    sched->set_live(u, false);
  }

  // After a use: starts the reads and all-gathers the trace says come next. Every rank makes the
  // same decisions (they depend on the trace and sizes only), so all-gathers stay in step.
  Status plan_ahead() {
    if (!policy.sharded_params || !sched->following()) return Status::ok();
    const uint64_t base_tick = static_cast<uint64_t>(steps) * sched->trace().size();
    if (s.param_home != Tier::kDevice) {
      for (size_t u : sched->reads_ahead()) {
        const UnitState& st = unit_states[u];
        if (auto next = sched->next_use(u)) store->set_next_use(st.params, base_tick + *next);
        store->prefetch(st.params, Tier::kDevice);
      }
    }
    for (size_t u : sched->gathers_ahead()) {
      ZINF_RETURN_IF_ERROR(start_gather(u));
      ++schedule_now.gathers_ahead;
    }
    return Status::ok();
  }

  // Step end: gathered parameters are about to change; nothing stays live.
  void drop_all_live() {
    for (size_t u = 0; u < unit_states.size(); ++u) {
      if (unit_states[u].gathered || unit_states[u].gather_in_flight) drop_live(u);
    }
  }

  // ---- gradient reduction ---------------------------------------------------------------------

  Status issue_reduction(size_t u, DeviceBuffer grads) {
    UnitState& st = unit_states[u];
    const auto& l = st.layout;
    const uint64_t wsize = dtype_size(s.dtype);
    Pending p{.unit = u, .grads = std::move(grads)};
    // overlap_optimizer: the unit is not used again in this step, so this reduction completes its
    // gradients.
    p.final = sched->following() && !sched->next_use(u) && st.scopes == 0;
    if (p.final && worker && can_update_early()) st.final_issued = true;
    if (!policy.owns_every_shard) {
      ZINF_ASSIGN_OR_RETURN(p.shard,
                            store->allocate_device(l.shard_numel * wsize, MemoryCategory::kBuffers,
                                                   "reduced gradient shard of " + units[u].name));
    }
    const uint64_t bucket = std::max<uint64_t>(s.reduce_bucket_elements, 1);
    auto* g = static_cast<char*>(p.grads.data());
    p.windows.push_back(device->comm_window(p.grads.data(), p.grads.bytes()));
    if (p.shard) p.windows.push_back(device->comm_window(p.shard.data(), p.shard.bytes()));
    for (uint64_t a = 0; a < l.numel_padded; a += bucket) {
      uint64_t b = std::min(l.numel_padded, a + bucket);
      if (policy.owns_every_shard) {
        p.works.push_back(
            comm.all_reduce(g + a * wsize, g + a * wsize, b - a, s.dtype, comm::ReduceOp::kAvg));
        comm_now.grad_reduce_elements += 2 * (b - a);
      } else {
        std::vector<size_t> counts(world);
        for (int r = 0; r < world; ++r) {
          uint64_t lo = std::max(a, l.shard_begin(r)), hi = std::min(b, l.shard_end(r));
          counts[r] = hi > lo ? hi - lo : 0;
        }
        uint64_t mine = std::max(a, l.shard_begin(rank));
        void* recv = static_cast<char*>(p.shard.data()) +
                     (mine < l.shard_end(rank) ? mine - l.shard_begin(rank) : 0) * wsize;
        p.works.push_back(
            comm.reduce_scatter_v(g + a * wsize, recv, counts, s.dtype, comm::ReduceOp::kAvg));
        comm_now.grad_reduce_elements += b - a;
      }
    }
    pending.push_back(std::move(p));
    if (!s.overlap_comm) return drain_pending();
    // Bound what is in flight: at most two units' gradients wait for their reduction.
    while (pending.size() > 2) ZINF_RETURN_IF_ERROR(finish_front());
    return Status::ok();
  }

  Status finish_front() {
    Pending p = std::move(pending.front());
    pending.pop_front();
    trace::Span span(track("comm"), "reduce " + units[p.unit].name);
    Status first;
    for (auto& w : p.works) {
      Status ws = w.wait();
      if (first.is_ok() && !ws.is_ok()) first = std::move(ws);
    }
    if (!first.is_ok()) {
      return std::move(first).with_context(
          fmt::format("reducing the gradients of unit {}", units[p.unit].name));
    }
    p.windows.clear();
    UnitState& st = unit_states[p.unit];
    // The first micro-step overwrites the (lazily zero) accumulators without fetching them; in
    // stage 1 the bytes outside this rank's range are then unspecified, and never read.
    const Access access = st.acc_zero ? Access::kOverwrite : Access::kRead;
    const uint64_t wsize = dtype_size(s.dtype);
    TensorHandle acc;  // consecutive pieces may share one accumulator (stage 1)
    for (size_t pi : st.pieces) {
      const PieceState& piece = pieces[pi];
      if (!acc || acc.id() != piece.acc) {
        acc.release();
        ZINF_ASSIGN_OR_RETURN(acc, store->acquire(piece.acc, compute_tier(st), access));
        acc.mark_dirty();
      }
      const char* reduced = policy.owns_every_shard
                                ? static_cast<const char*>(p.grads.data()) + piece.begin * wsize
                                : static_cast<const char*>(p.shard.data()) +
                                      (piece.begin - st.layout.shard_begin(rank)) * wsize;
      ZINF_RETURN_IF_ERROR(accumulate_into(acc, piece.begin - piece.acc_base, reduced,
                                           piece.end - piece.begin, /*overwrite=*/st.acc_zero));
    }
    acc.release();
    st.acc_zero = false;
    if (p.final) {
      st.grads_final = true;
      if (st.final_issued) {
        start_early_update(p.unit);
      } else if (read_during_backward) {
        read_optimizer_ahead();
      }
    }
    return Status::ok();
  }

  // The fp32 accumulator `acc` (from element `offset`) += the n working-dtype gradients at `src`
  // (device memory): a device operation when the accumulator is on the device; when it is on the
  // host (the optimizer offloaded), the gradients are copied down and added by the CPU kernel.
  Status accumulate_into(const TensorHandle& acc, uint64_t offset, const void* src, uint64_t n,
                         bool overwrite) {
    float* dst = static_cast<float*>(acc.data()) + offset;
    if (acc.tier() == Tier::kDevice) {
      device->accumulate({.data = dst, .dtype = DType::kF32, .numel = n}, {src, s.dtype, n},
                         overwrite, *stream);
      return sync(*stream);
    }
    host_scratch.resize(n * dtype_size(s.dtype));
    device->copy_async(host_scratch.data(), src, host_scratch.size(), *stream);
    ZINF_RETURN_IF_ERROR(sync(*stream));
    kernels::accumulate(dst, host_scratch.data(), s.dtype, n, overwrite, s.optimizer_threads);
    return Status::ok();
  }

  // Zeroes a tensor held at `h` where it is: a device operation, or memset on the host.
  Status zero(const TensorHandle& h) {
    if (h.tier() == Tier::kDevice) {
      device->fill({.data = h.data(), .dtype = DType::kF32, .numel = h.bytes() / 4}, 0.0f, *stream);
      return sync(*stream);
    }
    std::memset(h.data(), 0, h.bytes());
    return Status::ok();
  }

  Status drain_pending() {
    while (!pending.empty()) ZINF_RETURN_IF_ERROR(finish_front());
    return Status::ok();
  }

  // ---- the optimizer step ---------------------------------------------------------------------

  // Gradients are averaged over ranks by the reduction; here over micro-steps and the loss scale.
  float combined_scale() const {
    return static_cast<float>(
        1.0 / (static_cast<double>(s.gradient_accumulation_steps) * scaler.scale()));
  }
  bool need_norm() const { return s.gradient_clipping > 0; }
  bool need_overflow_check() const { return scaler.checks_overflow(); }
  // An update may run before step() only when it needs nothing from the other units' gradients.
  bool can_update_early() const { return !need_norm() && !need_overflow_check(); }

  // Sum of squares of this rank's accumulated gradients over `range_rank`'s shard of each unit,
  // adding the fixed 1024-element block sums left to right in unit order, so the result does not
  // depend on how the state is cut into pieces (stage 0 holds every shard and computes every
  // rank's partial itself).
  Result<double> partial_sum_squares(int range_rank, float scale_factor) {
    std::vector<size_t> selected;
    for (const UnitState& st : unit_states) {
      const uint64_t lo = st.layout.shard_begin(range_rank), hi = st.layout.shard_end(range_rank);
      for (size_t pi : st.pieces) {
        if (pieces[pi].begin >= lo && pieces[pi].end <= hi) selected.push_back(pi);
      }
    }
    double total = 0;
    std::vector<double> blocks;
    for (size_t i = 0; i < selected.size(); ++i) {
      if (i + 1 < selected.size()) {  // read the next accumulator while this one is summed
        const PieceState& next = pieces[selected[i + 1]];
        store->prefetch(next.acc, compute_tier(unit_states[next.unit]));
      }
      const PieceState& p = pieces[selected[i]];
      ZINF_ASSIGN_OR_RETURN(TensorHandle acc,
                            store->acquire(p.acc, compute_tier(unit_states[p.unit])));
      const uint64_t n = p.end - p.begin;
      blocks.resize(kernels::sum_squares_block_count(n));
      const float* grads = static_cast<const float*>(acc.data()) + (p.begin - p.acc_base);
      if (acc.tier() == Tier::kDevice) {
        device->sum_squares_blocks({grads, DType::kF32, n}, scale_factor, blocks.data(), *stream);
        ZINF_RETURN_IF_ERROR(sync(*stream));
      } else {
        kernels::grad_sum_squares_blocks(grads, DType::kF32, n, scale_factor, blocks.data(),
                                         s.optimizer_threads);
      }
      for (double b : blocks) total += b;
    }
    return total;
  }

  // Writes the zeros of accumulators that received no gradient this step (before they are read).
  Status materialise_zero_accumulators() {
    for (UnitState& st : unit_states) {
      if (!st.acc_zero) continue;
      for (size_t pi : st.pieces) {
        const PieceState& p = pieces[pi];
        if (!p.owns_acc && pi != st.pieces.front()) continue;  // a shared one: once
        ZINF_ASSIGN_OR_RETURN(TensorHandle acc,
                              store->acquire(p.acc, compute_tier(st), Access::kOverwrite));
        ZINF_RETURN_IF_ERROR(zero(acc));
        acc.mark_dirty();
      }
      st.acc_zero = false;
    }
    return Status::ok();
  }

  // Settles what the backward pass left in flight: reductions, overlapped updates, gathered
  // units; and closes the step in the scheduler.
  Status settle_backward(StepInfo& info) {
    Status st = drain_pending();
    if (worker) {
      Status w = worker->wait();
      if (st.is_ok()) st = std::move(w);
    }
    drop_all_live();
    schedule_now.following = sched->following();  // of the step that ends here
    if (!sched->on_step_end()) {
      log::warn_once("engine:trace-short",
                     "a step used fewer units than the recorded one; re-recording (reported once)");
    }
    plan_walk();
    info.units_updated_early = updated_early;
    updated_early = 0;
    for (UnitState& u : unit_states) u.final_issued = false;
    return st;
  }

  // A step either happens on every rank or on none. Every rank goes through the same
  // collectives whatever failed locally (a rank that failed sends a sentinel or a flag instead of
  // its data), so no rank is left waiting in a collective the others skipped; a failure anywhere
  // fails step() everywhere, each rank keeps the pieces it updated, and the next step() finishes
  // the update on every rank.
  Status step(StepInfo& info) {
    Status st = settle_backward(info);
    // An error recorded by a scope's end (its reduction could not be issued) fails the step:
    // the gradients are incomplete.
    if (!sticky.is_ok()) {
      if (st.is_ok()) st = std::move(sticky);
      sticky = Status();
    }
    const int64_t before = steps;
    st = update(info, std::move(st));
    // Not committed (a write-back error after the commit, or an fp16 skip, leaves nothing to
    // finish).
    update_incomplete = !st.is_ok() && steps == before && !info.skipped;
    return st;
  }

  // The optimizer step; `local` is what already failed on this rank (it then takes part in the
  // collectives without updating anything).
  Status update(StepInfo& info, Status local) {
    // A write-back that failed is reported, but the data stays valid in memory (and is written
    // back later): the step goes on.
    Status writeback = finish_evictions();
    if (local.is_ok()) local = materialise_zero_accumulators();
    const float combined = combined_scale();
    // One pass over the accumulators gives both the global norm and, for fp16, the overflow
    // check: the sum of squares is non-finite exactly when some gradient is.
    double norm_sq = 0;
    bool peer_failed = false;
    if (need_norm() || need_overflow_check()) {
      if (policy.owns_every_shard) {
        // Every rank holds every shard: compute each rank's partial exactly as that rank would.
        for (int r = 0; r < world && local.is_ok(); ++r) {
          auto p = partial_sum_squares(r, combined);
          if (p.is_ok()) {
            norm_sq += *p;
          } else {
            local = p.status();
          }
        }
      } else {
        double mine = engine_detail::StepAgreement::kFailed;
        if (local.is_ok()) {
          auto p = partial_sum_squares(rank, combined);
          if (p.is_ok()) {
            mine = *p;
          } else {
            local = p.status();
          }
        }
        ZINF_ASSIGN_OR_RETURN(std::vector<double> all, agreement.exchange_partials(mine));
        for (double p : all) {
          peer_failed |= p < 0;
          norm_sq += p;
        }
      }
    }
    const bool go = local.is_ok() && !peer_failed;
    info.grad_norm = go ? std::sqrt(norm_sq) : 0;
    // fp16: an overflow skips the update. Every rank sees the same partials and decides the same.
    const bool overflow = go && need_overflow_check() && !std::isfinite(norm_sq);
    if (go && !overflow) {
      float coef = 1.0f;
      if (need_norm() && info.grad_norm > s.gradient_clipping) {
        coef = static_cast<float>(s.gradient_clipping / (info.grad_norm + 1e-6));
      }
      local = update_pieces({.step = steps + 1, .grad_scale = combined * coef}, writeback);
    }
    ZINF_RETURN_IF_ERROR(agreement.agree(std::move(local)));
    if (overflow) {
      info.skipped = true;
      scaler.on_overflow();
      info.loss_scale = scaler.scale();
      info.step = steps;
      zero_gradients();
      return writeback;
    }
    // Committed on every rank: the next step starts from here.
    ++steps;
    std::fill(updated.begin(), updated.end(), 0);
    zero_gradients();
    if (policy.share_updated_params) ZINF_RETURN_IF_ERROR(gather_updated_parameters());
    scaler.on_good_step();
    info.step = steps;
    info.loss_scale = scaler.scale();
    Status end = finish_evictions();
    return writeback.is_ok() ? end : writeback;
  }

  // The optimizer walks the sub-groups as a pipeline: the reads of group g+1 are in flight while
  // g is updated, and g's write-back is in flight while g+1 is updated. Pieces already updated
  // (during the backward pass, or by a step() that failed half-way) are skipped.
  Status update_pieces(const kernels::AdamStepArgs& args, Status& writeback) {
    std::vector<std::vector<size_t>> todo;
    for (size_t g : walk) {
      todo.emplace_back();
      for (size_t pi : groups[g]) {
        if (!updated[pi]) todo.back().push_back(pi);
      }
      if (todo.back().empty()) todo.pop_back();
    }
    if (!todo.empty() && s.pipeline_read) prefetch_pieces(todo[0]);
    for (size_t g = 0; g < todo.size(); ++g) {
      if (g + 1 < todo.size() && s.pipeline_read) prefetch_pieces(todo[g + 1]);
      for (size_t pi : todo[g]) ZINF_RETURN_IF_ERROR(update_piece(pi, args));
      if (!s.pipeline_write) {
        Status wb = finish_evictions();
        if (writeback.is_ok()) writeback = std::move(wb);
      }
    }
    return Status::ok();
  }

  // After a step the accumulators are zero; the bytes are written only when needed.
  void zero_gradients() {
    for (UnitState& st : unit_states) st.acc_zero = true;
  }

  // Orders the optimizer's walk by when each group's gradients become final in the recorded
  // trace: a group is ready once the last use of each of its units is past.
  void plan_walk() {
    walk_prefetched = 0;
    for (UnitState& st : unit_states) st.grads_final = false;
    if (!sched->following()) return;  // keep the order of the last recorded trace
    const auto& trace = sched->trace();
    // A unit the trace never uses gets no final gradient in a step: its groups go last.
    std::vector<size_t> last_use(unit_states.size(), trace.size());
    for (size_t i = 0; i < trace.size(); ++i) last_use[trace[i]] = i;
    std::vector<size_t> ready(groups.size(), 0);
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t pi : groups[g]) ready[g] = std::max(ready[g], last_use[pieces[pi].unit]);
    }
    std::stable_sort(walk.begin(), walk.end(),
                     [&](size_t a, size_t b) { return ready[a] < ready[b]; });
  }

  // During the backward pass: starts reading the state of the first groups of the walk whose
  // gradients are all final, so that step() finds them in memory. At most
  // kGroupsReadDuringBackward groups (the host budget was sized for three in flight).
  void read_optimizer_ahead() {
    while (walk_prefetched < std::min(kGroupsReadDuringBackward, walk.size())) {
      const auto& group = groups[walk[walk_prefetched]];
      for (size_t pi : group) {
        if (!unit_states[pieces[pi].unit].grads_final) return;
      }
      prefetch_pieces(group);
      ++walk_prefetched;
    }
  }

  // Hands unit u's update to the optimizer worker; its gradients are final for this step. (A
  // group holding pieces of u and of other units is then updated partly early and partly in
  // step(), which skips what was done.)
  // The worker marks each piece in `updated` as it completes; nothing else touches those
  // entries until step() has waited for the worker.
  void start_early_update(size_t u) {
    ++updated_early;
    const kernels::AdamStepArgs args{.step = steps + 1, .grad_scale = combined_scale()};
    std::vector<size_t> mine = unit_states[u].pieces;
    worker->submit([this, mine, args]() -> Status {
      for (size_t k = 0; k < mine.size(); ++k) {
        if (s.pipeline_read) {  // this piece (the first time) and the next one
          if (k == 0) prefetch_piece(mine[0]);
          if (k + 1 < mine.size()) prefetch_piece(mine[k + 1]);
        }
        ZINF_RETURN_IF_ERROR(update_piece(mine[k], args));
      }
      return Status::ok();
    });
  }

  // Offloaded state does not stay above its home once used: write it back and drop the copy.
  void release_offloaded(TensorId id, Tier home, Tier where) {
    if (home == Tier::kNvme || (home == Tier::kHost && where == Tier::kDevice)) {
      auto f = store->evict_async(id, where);
      std::lock_guard lk(evictions_mu);
      evictions.push_back(std::move(f));
    }
  }

  Status finish_evictions() {
    std::vector<std::shared_future<Status>> mine;
    {
      std::lock_guard lk(evictions_mu);
      mine.swap(evictions);
    }
    Status first;
    for (auto& f : mine) {
      Status st = f.get();
      if (first.is_ok() && !st.is_ok()) first = std::move(st);
    }
    return first;
  }

  // Adam over one piece: its state and the unit's parameters where the update runs.
  Status update_piece(size_t pi, const kernels::AdamStepArgs& args) {
    const PieceState& p = pieces[pi];
    UnitState& st = unit_states[p.unit];
    const Tier tier = compute_tier(st);
    ZINF_ASSIGN_OR_RETURN(TensorHandle params, store->acquire(st.params, tier));
    TensorHandle master;
    if (mixed) {
      ZINF_ASSIGN_OR_RETURN(master, store->acquire(p.master, tier));
    }
    ZINF_ASSIGN_OR_RETURN(TensorHandle m, store->acquire(p.m, tier));
    ZINF_ASSIGN_OR_RETURN(TensorHandle v, store->acquire(p.v, tier));
    ZINF_ASSIGN_OR_RETURN(TensorHandle acc, store->acquire(p.acc, tier));
    const uint64_t wsize = dtype_size(s.dtype);
    {
      trace::Span span(track("cpu adam"), "adam " + units[p.unit].name);
      for (const zero::Segment& seg : zero::segments(st.layout, p.begin, p.end)) {
        kernels::AdamConfig cfg = s.adam;
        if (!seg.weight_decay) cfg.weight_decay = 0;
        const uint64_t si = seg.begin - p.begin, pidx = param_index(st, seg.begin);
        kernels::AdamTensors t{
            .param = mixed ? static_cast<float*>(master.data()) + si
                           : static_cast<float*>(params.data()) + pidx,
            .m = static_cast<float*>(m.data()) + si,
            .v = static_cast<float*>(v.data()) + si,
            .grad = static_cast<const float*>(acc.data()) + (seg.begin - p.acc_base),
            .grad_dtype = DType::kF32,
            .param_copy = mixed ? static_cast<char*>(params.data()) + pidx * wsize : nullptr,
            .copy_dtype = s.dtype,
            .n = seg.end - seg.begin};
        if (tier == Tier::kDevice) {
          device->adam(cfg, args, t, *optimizer_stream);
        } else {  // ZeRO-Offload: CPU Adam on host-resident state
          kernels::adam_step(cfg, args, t, s.optimizer_threads);
        }
      }
      if (tier == Tier::kDevice) ZINF_RETURN_IF_ERROR(sync(*optimizer_stream));
    }
    params.mark_dirty();
    if (mixed) master.mark_dirty();
    m.mark_dirty();
    v.mark_dirty();
    params.release();
    master.release();
    m.release();
    v.release();
    acc.release();
    updated[pi] = 1;
    // What the unit's pieces share (its parameters, a stage-1 accumulator) goes once all of
    // them are done: the walk may visit a unit's pieces out of order.
    const bool unit_done =
        std::all_of(st.pieces.begin(), st.pieces.end(), [&](size_t q) { return updated[q]; });
    if (tier != Tier::kDevice) {
      if (p.owns_acc || unit_done) release_offloaded(p.acc, st.opt_home, tier);
      release_offloaded(p.m, st.opt_home, tier);
      release_offloaded(p.v, st.opt_home, tier);
      if (mixed) release_offloaded(p.master, st.opt_home, tier);
    }
    if (policy.sharded_params && unit_done) release_offloaded(st.params, s.param_home, tier);
    return Status::ok();
  }

  // Starts bringing a piece's optimizer state (and its unit's parameters) to where the update
  // runs.
  void prefetch_piece(size_t pi) {
    const PieceState& p = pieces[pi];
    const UnitState& st = unit_states[p.unit];
    const Tier tier = compute_tier(st);
    for (TensorId id : {p.m, p.v, p.master, st.params, p.acc}) {
      if (id != kNoTensor) store->prefetch(id, tier);
    }
  }
  void prefetch_pieces(const std::vector<size_t>& which) {
    for (size_t pi : which) prefetch_piece(pi);
  }

  // Stages 1-2: every rank updated its shard of the full parameters; share them.
  Status gather_updated_parameters() {
    std::vector<TensorHandle> handles;
    std::vector<Device::CommWindow> windows;
    std::vector<comm::Work> works;
    const uint64_t wsize = dtype_size(s.dtype);
    Status first;
    for (UnitState& st : unit_states) {
      auto h = store->acquire(st.params, Tier::kDevice);
      if (!h.is_ok()) {  // the all-gathers issued so far write into `handles`: let them finish
        first = h.status();
        break;
      }
      auto* full = static_cast<char*>(h->data());
      windows.push_back(device->comm_window(full, st.layout.numel_padded * wsize));
      works.push_back(comm.all_gather(full + st.layout.shard_begin(rank) * wsize, full,
                                      st.layout.shard_numel, s.dtype));
      comm_now.param_gather_elements += st.layout.numel_padded;
      h->mark_dirty();
      handles.push_back(std::move(h).value());
    }
    for (auto& w : works) {
      Status ws = w.wait();
      if (first.is_ok() && !ws.is_ok()) first = std::move(ws);
    }
    return first;
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
  return sync(stream).with_context("reading the parameters of unit " +
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
  return sync(stream).with_context("writing the gradients of unit " +
                                   engine_->unit_spec(unit_).name);
}

Status UnitScope::finish() {
  if (engine_ == nullptr) return Status::ok();
  Engine* e = std::exchange(engine_, nullptr);
  Status s = e->end_scope(*this);
  if (!s.is_ok() && e->impl_->sticky.is_ok()) e->impl_->sticky = s;
  return s;
}

// ---- Engine -------------------------------------------------------------------------------------

Engine::Engine(const EngineSettings& settings, std::unique_ptr<Impl> impl)
    : settings_(settings), impl_(std::move(impl)) {}

Engine::~Engine() {
  if (!impl_) return;
  (void)impl_->drain_pending();
  if (impl_->worker) (void)impl_->worker->wait();
  impl_->drop_all_live();  // waits for all-gathers still writing into gathered buffers
  // After a failure some reductions may still be in flight: their buffers belong to the
  // communicator until their Work completes.
  for (auto& p : impl_->pending) {
    for (auto& w : p.works) (void)w.wait();
  }
  impl_->pending.clear();
  (void)impl_->finish_evictions();
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineSettings& settings,
                                               comm::Communicator& comm,
                                               std::vector<zero::UnitSpec> units, InitFn init) {
  if (units.empty()) return make_error(ErrorCode::kInvalidArgument, "the model has no units");
  if (!init) return make_error(ErrorCode::kInvalidArgument, "no parameter initialiser given");
  auto impl = std::make_unique<Impl>(settings, comm);
  impl->units = std::move(units);
  impl->init = std::move(init);
  ZINF_RETURN_IF_ERROR(impl->build());
  impl->ledger.reset_peaks();
  const EngineSettings effective = impl->s;  // with the budgets chosen
  return std::unique_ptr<Engine>(new Engine(effective, std::move(impl)));
}

Result<UnitScope> Engine::gather(size_t unit) {
  Impl& s = *impl_;
  if (!s.sticky.is_ok()) return std::exchange(s.sticky, Status());
  if (unit >= s.unit_states.size()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} does not exist ({} units)", unit,
                      s.unit_states.size());
  }
  Impl::UnitState& st = s.unit_states[unit];
  ZINF_RETURN_IF_ERROR(s.on_use(unit));
  UnitScope scope;
  scope.unit_ = unit;
  scope.opened_ = trace::Clock::now();
  if (!s.policy.sharded_params) {
    ZINF_ASSIGN_OR_RETURN(scope.param_handle_, s.store->acquire(st.params, Tier::kDevice));
    scope.params_ = scope.param_handle_.data();
    ++st.scopes;
    scope.engine_ = this;
    return scope;
  }
  // Stage 3: the unit's gathered parameters, all-gathered now unless fetched ahead or kept.
  if (st.gathered) {
    ++(st.used_since_gather ? s.schedule_now.uses_served_kept : s.schedule_now.uses_served_ahead);
  } else {
    ZINF_RETURN_IF_ERROR(s.start_gather(unit).with_context("gathering unit " + s.units[unit].name));
    ++s.schedule_now.gathers_on_demand;
  }
  ++st.scopes;
  st.used_since_gather = true;
  scope.engine_ = this;  // from here on the scope's end undoes the use
  // The next units' reads and all-gathers go out while this one's all-gather completes.
  ZINF_RETURN_IF_ERROR(s.plan_ahead());
  ZINF_RETURN_IF_ERROR(s.finish_gather(unit));
  scope.params_ = st.gathered.data();
  return scope;
}

Result<TensorView> Engine::scope_grads(UnitScope& scope) {
  Impl& s = *impl_;
  const auto& l = s.unit_states[scope.unit_].layout;
  const std::string& name = s.units[scope.unit_].name;
  if (!scope.grads_) {
    ZINF_ASSIGN_OR_RETURN(
        DeviceBuffer g,
        s.store->allocate_device(l.numel_padded * dtype_size(s.s.dtype), MemoryCategory::kGradients,
                                 "gradient buffer of " + name));
    s.device->fill({.data = g.data(), .dtype = DType::kF32, .numel = g.bytes() / 4}, 0.0f,
                   *s.stream);
    ZINF_RETURN_IF_ERROR(sync(*s.stream).with_context("zeroing the gradient buffer of " + name));
    scope.grads_ = std::move(g);
  }
  return TensorView(scope.grads_.data(), s.s.dtype, l.numel_padded,
                    "the gradients of unit " + name);
}

Status Engine::end_scope(UnitScope& scope) {
  Impl& s = *impl_;
  if (trace::enabled()) {
    trace::complete(s.track("compute"),
                    (scope.grads_ ? "backward " : "forward ") + s.units[scope.unit_].name,
                    scope.opened_);
  }
  scope.param_handle_.release();
  scope.params_ = nullptr;
  Impl::UnitState& st = s.unit_states[scope.unit_];
  --st.scopes;
  // Stage 3: the last scope on the unit lets its gathered parameters go, unless the unit is
  // persistent or reused soon.
  if (s.policy.sharded_params && st.scopes == 0 && !st.persistent && !s.sched->keep(scope.unit_)) {
    s.drop_live(scope.unit_);
  }
  if (!scope.grads_) return Status::ok();
  return s.issue_reduction(scope.unit_, std::move(scope.grads_));
}

Status Engine::step() {
  Impl& s = *impl_;
  StepInfo info;
  Status st = s.step(info);
  last_step_ = info;
  last_comm_ = s.comm_now;
  last_comm_.counters = s.comm.counters();
  s.comm.reset_counters();
  s.comm_now = CommReport{};
  last_schedule_ = s.schedule_now;
  last_schedule_.departures = s.sched->departures();
  s.schedule_now = ScheduleReport{.sub_groups = s.groups.size()};
  return st;
}

float Engine::loss_scale() const { return impl_->scaler.scale(); }

Device& Engine::device() const { return *impl_->device; }
Stream& Engine::stream() const { return *impl_->stream; }
const Budgets& Engine::budgets() const { return impl_->budgets; }

StoreStats Engine::store_stats() const { return impl_->store->stats(); }

MemoryReport Engine::memory_report() const {
  MemoryReport r;
  for (int t = 0; t < kNumTiers; ++t) r.tiers[t] = impl_->ledger.usage(static_cast<Tier>(t));
  return r;
}

Result<std::vector<float>> Engine::full_parameters(size_t unit) {
  Impl& s = *impl_;
  if (unit >= s.unit_states.size()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} does not exist", unit);
  }
  ZINF_RETURN_IF_ERROR(s.drain_pending());
  if (s.worker) ZINF_RETURN_IF_ERROR(s.worker->wait());
  Impl::UnitState& st = s.unit_states[unit];
  const auto& l = st.layout;
  std::vector<float> full(l.numel_padded);
  // Each rank contributes its owned fp32 values; stage 0 owns everything, so it contributes
  // its shard-sized slice like the others.
  std::vector<float> mine(l.shard_numel);
  uint64_t begin = l.shard_begin(s.rank);
  if (s.mixed) {
    for (size_t pi : st.pieces) {  // the pieces of this rank's shard
      const Impl::PieceState& p = s.pieces[pi];
      if (p.begin < begin || p.end > l.shard_end(s.rank)) continue;
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, s.store->acquire(p.master, Tier::kHost));
      std::memcpy(mine.data() + (p.begin - begin), h.data(), (p.end - p.begin) * 4);
    }
  } else {
    ZINF_ASSIGN_OR_RETURN(TensorHandle h, s.store->acquire(st.params, Tier::kHost));
    std::memcpy(mine.data(), static_cast<float*>(h.data()) + s.param_index(st, begin),
                l.shard_numel * 4);
  }
  ZINF_RETURN_IF_ERROR(
      s.comm.all_gather(mine.data(), full.data(), l.shard_numel, DType::kF32).wait());
  s.comm.reset_counters();
  full.resize(l.numel);
  return full;
}

size_t Engine::unit_count() const { return impl_->unit_states.size(); }
const zero::ShardLayout& Engine::layout(size_t unit) const {
  return impl_->unit_states.at(unit).layout;
}
const zero::UnitSpec& Engine::unit_spec(size_t unit) const { return impl_->units.at(unit); }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }

}  // namespace zinf
