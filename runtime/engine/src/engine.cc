#include "zinf/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>

#include "zinf/core/log.h"
#include "zinf/core/trace.h"
#include "zinf/core/units.h"
#include "zinf/io/io_engine.h"
#include "zinf/io/swap_space.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/pinned_pool.h"

namespace zinf {
namespace {

constexpr uint64_t kUnlimited = uint64_t{1} << 50;
constexpr TensorId kNoTensor = ~TensorId{0};

std::string unit_tensor_name(const zero::UnitSpec& u, const char* what) {
  return fmt::format("{}.{}", u.name, what);
}

// dst[i] += (float)src[i] for a working-dtype source; with `first`, dst[i] = 0.0f + (float)src[i]
// without reading dst (the same bits as adding to a zeroed accumulator).
template <typename Load>
void add_into(float* dst, uint64_t n, bool first, Load load) {
  if (first) {
    for (uint64_t i = 0; i < n; ++i) dst[i] = 0.0f + load(i);
  } else {
    for (uint64_t i = 0; i < n; ++i) dst[i] += load(i);
  }
}

void accumulate(float* dst, const void* src, DType dtype, uint64_t n, bool first) {
  auto* f = static_cast<const float*>(src);
  auto* h = static_cast<const uint16_t*>(src);
  switch (dtype) {
    case DType::kF32:
      add_into(dst, n, first, [f](uint64_t i) { return f[i]; });
      break;
    case DType::kBF16:
      add_into(dst, n, first, [h](uint64_t i) { return bf16_to_f32(h[i]); });
      break;
    case DType::kF16:
      add_into(dst, n, first, [h](uint64_t i) { return f16_to_f32(h[i]); });
      break;
  }
}

void store_value(void* base, DType dtype, uint64_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = f32_to_f16(v);
      break;
  }
}

}  // namespace

struct Engine::Impl {
  EngineSettings s;
  comm::Communicator& comm;
  std::vector<zero::UnitSpec> units;
  InitFn init;
  int rank = 0, world = 1;
  bool mixed = false;  // working dtype is not fp32: a separate fp32 master exists

  Ledger ledger;
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<Device> device;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<TieredTensorStore> store;

  struct UnitState {
    zero::ShardLayout layout;
    TensorId params = kNoTensor;            // working dtype: full (stages 0-2) or shard (stage 3)
    TensorId master = kNoTensor;            // fp32 master when mixed: full (stage 0) or shard
    TensorId m = kNoTensor, v = kNoTensor;  // fp32: full (stage 0) or shard
    TensorId grad_acc = kNoTensor;          // fp32: full (stages 0-1) or shard (2-3)
    // The accumulator holds zeros in this rank's range (without its bytes having been written:
    // zeroing is lazy, so an offloaded accumulator is not read and written just to clear it).
    bool acc_zero = true;
    Tier opt_home = Tier::kDevice;  // the optimizer's home for this unit (partial offload)
    // Stage 3, units of at most stage3_param_persistence_threshold elements: the gathered
    // parameters stay on the device, all-gathered once per step (after each update).
    bool persistent = false;
    DeviceBuffer gathered;
    int64_t gathered_at_step = -1;
  };
  std::vector<UnitState> unit_states;

  // Reductions issued at scope end, accumulated when they complete (in issue order).
  struct Pending {
    size_t unit;
    DeviceBuffer grads;  // the full gradient buffer (reduced in place for stage 0)
    DeviceBuffer shard;  // stages 1-3: this rank's reduced part
    std::vector<comm::Work> works;
  };
  std::deque<Pending> pending;
  Status sticky;  // an error from a scope's destructor, reported by the next call

  // The scheduler: the order in which units are gathered, recorded during the first step and
  // followed afterwards to prefetch ahead.
  std::vector<size_t> trace;
  size_t trace_pos = 0;
  bool recording = true;
  std::vector<std::shared_future<Status>> evictions;  // write-backs in flight

  // Step state.
  int64_t steps = 0;
  float scale = 1;
  int good_steps = 0;
  int hysteresis_left = 0;
  CommReport comm_now;  // counts since the last step

  Impl(const EngineSettings& settings, comm::Communicator& c) : s(settings), comm(c) {}

  // "rank<r> <what>": this rank's track in a trace.
  std::string track(const char* what) const {
    return *what ? fmt::format("rank{} {}", rank, what) : fmt::format("rank{}", rank);
  }

  // Where unit u's optimizer state lives and where its update runs (device, or the CPU for
  // state offloaded to host memory or NVMe).
  Tier compute_tier(const struct UnitState& st) const {
    return st.opt_home == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  }
  uint64_t owned_begin(const UnitState& u) const {
    return s.stage == 0 ? 0 : u.layout.shard_begin(rank);
  }
  uint64_t owned_end(const UnitState& u) const {
    return s.stage == 0 ? u.layout.numel_padded : u.layout.shard_end(rank);
  }
  // Index of flat element `flat` in the unit's tensors.
  uint64_t param_index(const UnitState& u, uint64_t flat) const {
    return s.stage == 3 ? flat - u.layout.shard_begin(rank) : flat;
  }
  uint64_t state_index(const UnitState& u, uint64_t flat) const {
    return s.stage == 0 ? flat : flat - u.layout.shard_begin(rank);
  }
  uint64_t acc_index(const UnitState& u, uint64_t flat) const {
    return s.stage <= 1 ? flat : flat - u.layout.shard_begin(rank);
  }

  Result<TensorId> make_tensor(const zero::UnitSpec& spec, const char* what, uint64_t bytes,
                               Tier home, MemoryCategory category) {
    return store->create_tensor(TensorSpec{
        .name = unit_tensor_name(spec, what), .bytes = bytes, .home = home, .category = category});
  }

  Status build() {
    rank = comm.rank();
    world = comm.world_size();
    mixed = s.dtype != DType::kF32;
    if (s.stage < 0 || s.stage > 3) {
      return make_error(ErrorCode::kInvalidArgument, "ZeRO stage must be 0..3, got {}", s.stage);
    }
    if (s.param_home != Tier::kDevice && s.stage != 3) {
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
    // Resources of this rank: device, pinned host pool, NVMe swap, the store over them.
    device = make_cpu_device(
        {.budget_bytes = s.device_mem ? s.device_mem : kUnlimited, .ledger = &ledger});
    bool nvme = s.param_home == Tier::kNvme || s.optimizer_home == Tier::kNvme;
    if (nvme) {
      ZINF_ASSIGN_OR_RETURN(io, io::IoEngine::create({.queue_depth = s.io_queue_depth,
                                                      .block_size = s.io_block_size,
                                                      .rings = s.io_rings}));
      std::vector<std::string> dirs = s.nvme_paths;
      ZINF_ASSIGN_OR_RETURN(
          swap, io::SwapSpace::create(*io, {.directories = dirs, .checksum = s.checksum}));
    }
    pool = std::make_unique<PinnedPool>(
        PinnedPoolOptions{.budget_bytes = s.host_mem ? s.host_mem : kUnlimited,
                          .engine = io.get(),
                          .ledger = &ledger});
    ZINF_ASSIGN_OR_RETURN(store, TieredTensorStore::create({.device = device.get(),
                                                            .host = pool.get(),
                                                            .swap = swap.get(),
                                                            .ledger = &ledger,
                                                            .staging_bytes = s.staging_bytes,
                                                            .staging_buffers = s.staging_buffers,
                                                            .trace_name = track("")}));
    if (s.static_loss_scale > 0) {
      scale = s.static_loss_scale;
    } else if (s.dtype == DType::kF16) {
      scale = std::ldexp(1.0f, s.initial_scale_power);
    }
    hysteresis_left = s.hysteresis;

    const uint64_t wsize = dtype_size(s.dtype);
    // Partial offload (DeepSpeed's Twin-Flow `ratio`): the first units, in declaration order,
    // holding about `ratio` of the parameters have their optimizer state offloaded; the others
    // keep it on the device and are updated there.
    if (!(s.optimizer_offload_ratio > 0 && s.optimizer_offload_ratio <= 1)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "offload_optimizer.ratio must be in (0, 1], got {}",
                        s.optimizer_offload_ratio);
    }
    uint64_t total_numel = 0, offloaded_numel = 0;
    std::vector<zero::ShardLayout> layouts;
    for (const auto& unit : units) {
      ZINF_ASSIGN_OR_RETURN(zero::ShardLayout l, zero::make_shard_layout(unit, world, s.dtype));
      total_numel += l.numel;
      layouts.push_back(std::move(l));
    }
    for (size_t u = 0; u < units.size(); ++u) {
      UnitState st;
      st.layout = layouts[u];
      st.persistent = s.stage == 3 && st.layout.numel <= s.param_persistence_threshold;
      st.opt_home = Tier::kDevice;
      if (s.optimizer_home != Tier::kDevice &&
          static_cast<double>(offloaded_numel) + st.layout.numel / 2.0 <=
              s.optimizer_offload_ratio * static_cast<double>(total_numel)) {
        st.opt_home = s.optimizer_home;
        offloaded_numel += st.layout.numel;
      }
      const uint64_t full = st.layout.numel_padded, shard = st.layout.shard_numel;
      const uint64_t state_n = s.stage == 0 ? full : shard;
      ZINF_ASSIGN_OR_RETURN(st.params,
                            make_tensor(units[u], "params", (s.stage == 3 ? shard : full) * wsize,
                                        s.param_home, MemoryCategory::kParameters));
      if (mixed) {
        ZINF_ASSIGN_OR_RETURN(st.master, make_tensor(units[u], "master", state_n * 4, st.opt_home,
                                                     MemoryCategory::kOptimizerStates));
      }
      ZINF_ASSIGN_OR_RETURN(st.m, make_tensor(units[u], "adam_m", state_n * 4, st.opt_home,
                                              MemoryCategory::kOptimizerStates));
      ZINF_ASSIGN_OR_RETURN(st.v, make_tensor(units[u], "adam_v", state_n * 4, st.opt_home,
                                              MemoryCategory::kOptimizerStates));
      // The fp32 gradient shard lives with the optimizer state (device, host or NVMe), so that
      // with NVMe offload no training state is bound to memory (the host budget caches it).
      ZINF_ASSIGN_OR_RETURN(st.grad_acc,
                            make_tensor(units[u], "grad_acc", (s.stage <= 1 ? full : shard) * 4,
                                        st.opt_home, MemoryCategory::kGradients));
      unit_states.push_back(std::move(st));
      ZINF_RETURN_IF_ERROR(initialise(u));
    }
    return Status::ok();
  }

  // Fills the parameters this rank holds (and its fp32 master) from the init function.
  Status initialise(size_t u) {
    UnitState& st = unit_states[u];
    const auto& l = st.layout;
    uint64_t p_begin = s.stage == 3 ? l.shard_begin(rank) : 0;
    uint64_t p_end = s.stage == 3 ? l.shard_end(rank) : l.numel_padded;
    {
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, store->acquire(st.params, Tier::kHost));
      for (uint64_t flat = p_begin; flat < p_end; ++flat) {
        float value = flat < l.numel ? init(u, flat, s.seed) : 0.0f;
        store_value(h.data(), s.dtype, flat - p_begin, value);
      }
      h.mark_dirty();
    }
    if (mixed) {
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, store->acquire(st.master, Tier::kHost));
      auto* master = static_cast<float*>(h.data());
      for (uint64_t flat = owned_begin(st); flat < owned_end(st); ++flat) {
        master[state_index(st, flat)] = flat < l.numel ? init(u, flat, s.seed) : 0.0f;
      }
      h.mark_dirty();
    }
    // Resident where they are used; the host copy written above is not kept.
    if (s.param_home != Tier::kHost) {
      { ZINF_ASSIGN_OR_RETURN(TensorHandle d, store->acquire(st.params, Tier::kDevice)); }
      ZINF_RETURN_IF_ERROR(store->evict(st.params, Tier::kHost));
    }
    if (mixed && st.opt_home != Tier::kHost) {
      ZINF_RETURN_IF_ERROR(store->flush(st.master));
      if (st.opt_home == Tier::kNvme) ZINF_RETURN_IF_ERROR(store->evict(st.master, Tier::kHost));
    }
    return Status::ok();
  }

  // ---- gradient reduction ---------------------------------------------------------------------

  Status issue_reduction(size_t u, DeviceBuffer grads) {
    UnitState& st = unit_states[u];
    const auto& l = st.layout;
    const uint64_t wsize = dtype_size(s.dtype);
    Pending p{.unit = u, .grads = std::move(grads)};
    if (s.stage >= 1) {
      ZINF_ASSIGN_OR_RETURN(p.shard,
                            store->allocate_device(l.shard_numel * wsize, MemoryCategory::kBuffers,
                                                   "reduced gradient shard of " + units[u].name));
    }
    const uint64_t bucket = std::max<uint64_t>(s.reduce_bucket_elements, 1);
    auto* g = static_cast<char*>(p.grads.data());
    for (uint64_t a = 0; a < l.numel_padded; a += bucket) {
      uint64_t b = std::min(l.numel_padded, a + bucket);
      if (s.stage == 0) {
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
    UnitState& st = unit_states[p.unit];
    ZINF_CHECK(device->host_addressable(), "gradient accumulation from device memory needs a copy");
    // The first micro-step overwrites the (lazily zero) accumulator without fetching it; in stage
    // 1 the bytes outside this rank's range are then unspecified, and never read.
    const Access access = st.acc_zero ? Access::kOverwrite : Access::kRead;
    ZINF_ASSIGN_OR_RETURN(TensorHandle acc, store->acquire(st.grad_acc, compute_tier(st), access));
    auto* a = static_cast<float*>(acc.data());
    uint64_t begin = owned_begin(st), end = owned_end(st);
    const void* reduced = s.stage == 0 ? p.grads.data() : p.shard.data();
    float* into = s.stage == 0 ? a : a + acc_index(st, begin);
    accumulate(into, reduced, s.dtype, end - begin, /*first=*/st.acc_zero);
    st.acc_zero = false;
    acc.mark_dirty();
    return Status::ok();
  }

  Status drain_pending() {
    while (!pending.empty()) ZINF_RETURN_IF_ERROR(finish_front());
    return Status::ok();
  }

  // ---- the optimizer step ---------------------------------------------------------------------

  // Sum of squares of this rank's accumulated gradients over `range_rank`'s shard of each unit,
  // in unit order (stage 0 holds every shard and computes every rank's partial itself).
  Result<double> partial_sum_squares(int range_rank, float scale_factor) {
    double total = 0;
    for (UnitState& st : unit_states) {
      ZINF_ASSIGN_OR_RETURN(TensorHandle acc, store->acquire(st.grad_acc, compute_tier(st)));
      uint64_t begin = st.layout.shard_begin(range_rank);
      const float* a = static_cast<const float*>(acc.data()) + acc_index(st, begin);
      total += kernels::grad_sum_squares(a, DType::kF32, st.layout.shard_numel, scale_factor,
                                         s.optimizer_threads);
    }
    return total;
  }

  // Everyone's partial sum of squares, in rank order (8 bytes per rank, gathered as raw bits).
  Result<std::vector<double>> exchange_partials(double partial) {
    std::vector<double> all(world);
    comm::Work w = comm.all_gather(&partial, all.data(), sizeof(double) / 4, DType::kF32);
    comm_now.control_elements += world * sizeof(double) / 4;
    ZINF_RETURN_IF_ERROR(w.wait());
    return all;
  }

  // After a step the accumulators are zero; the bytes are written only when needed.
  Status zero_gradients() {
    for (UnitState& st : unit_states) st.acc_zero = true;
    return Status::ok();
  }

  // Writes the zeros of accumulators that received no gradient this step (before they are read).
  Status materialise_zero_accumulators() {
    for (UnitState& st : unit_states) {
      if (!st.acc_zero) continue;
      ZINF_ASSIGN_OR_RETURN(TensorHandle acc,
                            store->acquire(st.grad_acc, compute_tier(st), Access::kOverwrite));
      std::memset(acc.data(), 0, acc.bytes());
      acc.mark_dirty();
      st.acc_zero = false;
    }
    return Status::ok();
  }

  Status step(StepInfo& info) {
    ZINF_RETURN_IF_ERROR(drain_pending());
    if (recording && !trace.empty()) {
      recording = false;  // the first full step is the trace
    } else if (!recording && trace_pos != trace.size()) {
      log::warn_once("engine:trace-short",
                     "a step gathered fewer units than the recorded one; "
                     "re-recording");
      recording = true;
      trace.clear();
    }
    trace_pos = 0;
    ZINF_RETURN_IF_ERROR(finish_evictions());
    ZINF_RETURN_IF_ERROR(materialise_zero_accumulators());
    // Gradients are averaged over ranks by the reduction; here over micro-steps and the loss scale.
    const float combined =
        static_cast<float>(1.0 / (static_cast<double>(s.gradient_accumulation_steps) * scale));
    bool need_norm = s.gradient_clipping > 0;
    bool need_overflow = s.dtype == DType::kF16;
    // One pass over the accumulators gives both the global norm and, for fp16, the overflow
    // check: the sum of squares is non-finite exactly when some gradient is.
    double norm_sq = 0;
    if (need_norm || need_overflow) {
      if (s.stage == 0) {
        // Every rank holds every shard: compute each rank's partial exactly as that rank would.
        for (int r = 0; r < world; ++r) {
          ZINF_ASSIGN_OR_RETURN(double p, partial_sum_squares(r, combined));
          norm_sq += p;
        }
      } else {
        ZINF_ASSIGN_OR_RETURN(double mine, partial_sum_squares(rank, combined));
        ZINF_ASSIGN_OR_RETURN(std::vector<double> all, exchange_partials(mine));
        for (double p : all) norm_sq += p;
      }
    }
    info.grad_norm = std::sqrt(norm_sq);
    const bool overflow = need_overflow && !std::isfinite(norm_sq);
    if (overflow) {
      // fp16: skip the update, lower the scale (after `hysteresis` overflows), as DeepSpeed.
      info.skipped = true;
      if (s.static_loss_scale == 0 && --hysteresis_left <= 0) {
        scale = std::max(scale / 2, s.min_loss_scale);
        hysteresis_left = s.hysteresis;
      }
      good_steps = 0;
      info.loss_scale = scale;
      info.step = steps;
      return zero_gradients();
    }
    float coef = 1.0f;
    if (need_norm && info.grad_norm > s.gradient_clipping) {
      coef = static_cast<float>(s.gradient_clipping / (info.grad_norm + 1e-6));
    }
    ++steps;
    kernels::AdamStepArgs args{.step = steps, .grad_scale = combined * coef};
    // The optimizer walks the units as a pipeline: the reads of unit u+1 are in flight while u is
    // updated, and u's write-back is in flight while u+1 is updated.
    if (!unit_states.empty()) prefetch_optimizer(0);
    for (size_t u = 0; u < unit_states.size(); ++u) {
      if (u + 1 < unit_states.size()) prefetch_optimizer(u + 1);
      ZINF_RETURN_IF_ERROR(update_unit(u, args));
    }
    ZINF_RETURN_IF_ERROR(zero_gradients());
    if (s.stage == 1 || s.stage == 2) ZINF_RETURN_IF_ERROR(gather_updated_parameters());
    if (s.dtype == DType::kF16 && s.static_loss_scale == 0 && ++good_steps >= s.loss_scale_window) {
      scale *= 2;
      good_steps = 0;
    }
    info.step = steps;
    info.loss_scale = scale;
    // The update is complete in memory. A failed write-back is reported, but the data stays
    // valid where it is (and is written back later): training can go on.
    return finish_evictions();
  }

  // Called at each gather: records the order, or follows it and prefetches the next units'
  // parameters to the device (bounded by prefetch_units).
  void schedule_gather(size_t u) {
    if (recording) {
      trace.push_back(u);
      return;
    }
    if (trace_pos >= trace.size() || trace[trace_pos] != u) {
      log::warn_once("engine:trace",
                     "the order of unit gathers differs from the recorded step; "
                     "re-recording it (prefetching resumes after the next step)");
      recording = true;
      trace.clear();
      trace.push_back(u);
      return;
    }
    ++trace_pos;
    if (s.param_home == Tier::kDevice) return;  // resident anyway
    for (size_t k = 0; k < s.prefetch_units && trace_pos + k < trace.size(); ++k) {
      const UnitState& next = unit_states[trace[trace_pos + k]];
      store->set_next_use(next.params, steps * trace.size() + trace_pos + k);
      store->prefetch(next.params, Tier::kDevice);
    }
  }

  // Offloaded state does not stay above its home once used: write it back and drop the copy.
  void release_offloaded(TensorId id, Tier home, Tier where) {
    if (home == Tier::kNvme || (home == Tier::kHost && where == Tier::kDevice)) {
      evictions.push_back(store->evict_async(id, where));
    }
  }

  Status finish_evictions() {
    Status first;
    for (auto& f : evictions) {
      Status st = f.get();
      if (first.is_ok() && !st.is_ok()) first = std::move(st);
    }
    evictions.clear();
    return first;
  }

  Status update_unit(size_t u, const kernels::AdamStepArgs& args) {
    UnitState& st = unit_states[u];
    const Tier tier = compute_tier(st);
    ZINF_ASSIGN_OR_RETURN(TensorHandle params, store->acquire(st.params, tier));
    TensorHandle master;
    if (mixed) {
      ZINF_ASSIGN_OR_RETURN(master, store->acquire(st.master, tier));
    }
    ZINF_ASSIGN_OR_RETURN(TensorHandle m, store->acquire(st.m, tier));
    ZINF_ASSIGN_OR_RETURN(TensorHandle v, store->acquire(st.v, tier));
    ZINF_ASSIGN_OR_RETURN(TensorHandle acc, store->acquire(st.grad_acc, tier));
    const uint64_t wsize = dtype_size(s.dtype);
    trace::Span span(track("cpu adam"), "adam " + units[u].name);
    for (const zero::Segment& seg : zero::segments(st.layout, owned_begin(st), owned_end(st))) {
      kernels::AdamConfig cfg = s.adam;
      if (!seg.weight_decay) cfg.weight_decay = 0;
      uint64_t si = state_index(st, seg.begin), pi = param_index(st, seg.begin);
      kernels::AdamTensors t{
          .param = mixed ? static_cast<float*>(master.data()) + si
                         : static_cast<float*>(params.data()) + pi,
          .m = static_cast<float*>(m.data()) + si,
          .v = static_cast<float*>(v.data()) + si,
          .grad = static_cast<const float*>(acc.data()) + acc_index(st, seg.begin),
          .grad_dtype = DType::kF32,
          .param_copy = mixed ? static_cast<char*>(params.data()) + pi * wsize : nullptr,
          .copy_dtype = s.dtype,
          .n = seg.end - seg.begin};
      kernels::adam_step(cfg, args, t, s.optimizer_threads);
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
    if (tier != Tier::kDevice) {
      release_offloaded(st.grad_acc, st.opt_home, tier);
      release_offloaded(st.m, st.opt_home, tier);
      release_offloaded(st.v, st.opt_home, tier);
      if (mixed) release_offloaded(st.master, st.opt_home, tier);
    }
    if (s.stage == 3) release_offloaded(st.params, s.param_home, tier);
    return Status::ok();
  }

  // Starts bringing unit u's optimizer state to where the update runs.
  void prefetch_optimizer(size_t u) {
    const UnitState& st = unit_states[u];
    const Tier tier = compute_tier(st);
    for (TensorId id : {st.m, st.v, st.master, st.params, st.grad_acc}) {
      if (id != kNoTensor) store->prefetch(id, tier);
    }
  }

  // Stages 1-2: every rank updated its shard of the full parameters; share them.
  Status gather_updated_parameters() {
    std::vector<TensorHandle> handles;
    std::vector<comm::Work> works;
    const uint64_t wsize = dtype_size(s.dtype);
    for (UnitState& st : unit_states) {
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, store->acquire(st.params, Tier::kDevice));
      auto* full = static_cast<char*>(h.data());
      works.push_back(comm.all_gather(full + st.layout.shard_begin(rank) * wsize, full,
                                      st.layout.shard_numel, s.dtype));
      comm_now.param_gather_elements += st.layout.numel_padded;
      h.mark_dirty();
      handles.push_back(std::move(h));
    }
    Status first;
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
    gathered_ = std::move(o.gathered_);
    grads_ = std::move(o.grads_);
    opened_ = o.opened_;
  }
  return *this;
}

// A failure at scope end is recorded by finish() and reported by the next gather() or step().
UnitScope::~UnitScope() { (void)finish(); }

const zero::ShardLayout& UnitScope::layout() const { return engine_->layout(unit_); }

void* UnitScope::grads() { return engine_->scope_grads(*this); }

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
  return std::unique_ptr<Engine>(new Engine(settings, std::move(impl)));
}

Result<UnitScope> Engine::gather(size_t unit) {
  Impl& s = *impl_;
  if (!s.sticky.is_ok()) return std::exchange(s.sticky, Status());
  if (unit >= s.unit_states.size()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} does not exist ({} units)", unit,
                      s.unit_states.size());
  }
  Impl::UnitState& st = s.unit_states[unit];
  s.schedule_gather(unit);
  UnitScope scope;
  scope.engine_ = this;
  scope.unit_ = unit;
  scope.opened_ = trace::Clock::now();
  if (st.persistent && st.gathered && st.gathered_at_step == s.steps) {
    // Gathered earlier in this step and kept (stage3_param_persistence_threshold).
    scope.params_ = st.gathered.data();
    return scope;
  }
  ZINF_ASSIGN_OR_RETURN(TensorHandle h, s.store->acquire(st.params, Tier::kDevice));
  if (s.s.stage < 3) {
    scope.params_ = h.data();
    scope.param_handle_ = std::move(h);
    return scope;
  }
  const uint64_t wsize = dtype_size(s.s.dtype);
  auto full =
      st.persistent && st.gathered
          ? Result<DeviceBuffer>(DeviceBuffer())
          : s.store->allocate_device(st.layout.numel_padded * wsize, MemoryCategory::kParameters,
                                     "gathered parameters of " + s.units[unit].name);
  if (!full.is_ok()) {
    scope.engine_ = nullptr;
    return std::move(full).take_status().with_context("gathering unit " + s.units[unit].name);
  }
  void* into = *full ? full->data() : st.gathered.data();
  comm::Work w = s.comm.all_gather(h.data(), into, st.layout.shard_numel, s.s.dtype);
  s.comm_now.param_gather_elements += st.layout.numel_padded;
  Status ws;
  {
    trace::Span span(s.track("comm"), "all-gather " + s.units[unit].name);
    ws = w.wait();
  }
  if (!ws.is_ok()) {
    scope.engine_ = nullptr;
    return std::move(ws).with_context("gathering unit " + s.units[unit].name);
  }
  if (st.persistent) {
    if (*full) st.gathered = std::move(full).value();
    st.gathered_at_step = s.steps;
    scope.params_ = st.gathered.data();
  } else {
    scope.gathered_ = std::move(full).value();
    scope.params_ = scope.gathered_.data();
  }
  h.release();
  s.release_offloaded(st.params, s.s.param_home, Tier::kDevice);
  return scope;
}

void* Engine::scope_grads(UnitScope& scope) {
  if (!scope.grads_) {
    Impl& s = *impl_;
    const auto& l = s.unit_states[scope.unit_].layout;
    auto g =
        s.store->allocate_device(l.numel_padded * dtype_size(s.s.dtype), MemoryCategory::kGradients,
                                 "gradient buffer of " + s.units[scope.unit_].name);
    if (!g.is_ok()) {
      if (s.sticky.is_ok()) s.sticky = g.status();
      return nullptr;
    }
    std::memset(g->data(), 0, g->bytes());
    scope.grads_ = std::move(g).value();
  }
  return scope.grads_.data();
}

Status Engine::end_scope(UnitScope& scope) {
  Impl& s = *impl_;
  if (trace::enabled()) {
    trace::complete(s.track("compute"),
                    (scope.grads_ ? "backward " : "forward ") + s.units[scope.unit_].name,
                    scope.opened_);
  }
  scope.param_handle_.release();
  scope.gathered_.reset();
  scope.params_ = nullptr;
  if (!scope.grads_) return Status::ok();
  return s.issue_reduction(scope.unit_, std::move(scope.grads_));
}

Status Engine::step() {
  Impl& s = *impl_;
  if (!s.sticky.is_ok()) return std::exchange(s.sticky, Status());
  StepInfo info;
  Status st = s.step(info);
  last_step_ = info;
  last_comm_ = s.comm_now;
  last_comm_.counters = s.comm.counters();
  s.comm.reset_counters();
  s.comm_now = CommReport{};
  return st;
}

float Engine::loss_scale() const { return impl_->scale; }

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
  Impl::UnitState& st = s.unit_states[unit];
  const auto& l = st.layout;
  std::vector<float> full(l.numel_padded);
  // Each rank contributes its owned fp32 values; stage 0 owns everything, so it contributes
  // its shard-sized slice like the others.
  std::vector<float> mine(l.shard_numel);
  uint64_t begin = l.shard_begin(s.rank);
  if (s.mixed) {
    ZINF_ASSIGN_OR_RETURN(TensorHandle h, s.store->acquire(st.master, Tier::kHost));
    std::memcpy(mine.data(), static_cast<float*>(h.data()) + s.state_index(st, begin),
                l.shard_numel * 4);
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
