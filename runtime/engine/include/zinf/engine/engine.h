// Engine: ZeRO stages 0-3 over one rank's Communicator.
//
// Usage, per rank (each rank is a thread with the local communicator, or a process under MPI):
//
//   auto engine = Engine::create(settings, comm, units, init).value();
//   for (step...) {
//     for (micro-batch in gradient_accumulation_steps) {
//       for (u : forward order) { auto s = engine->gather(u).value(); forward(u, s.params()); }
//       for (u : backward order) {
//         auto s = engine->gather(u).value();
//         backward(u, s.params(), s.grads());   // accumulate (+=) into grads()
//       }                                       // scope end: grads are reduce-scattered
//     }
//     engine->step();
//   }
//
// What each stage holds per rank (P = padded parameter elements, N = world size; fp32):
//   stage 0: full parameters, full gradient accumulator, full Adam m and v        (4P)
//   stage 1: full parameters, full gradient accumulator, m and v of its shard      (2P + 2P/N)
//   stage 2: full parameters, gradient shard, m and v of its shard                 (P + 3P/N)
//   stage 3: parameter shard, gradient shard, m and v of its shard                 (4P/N)
// plus, transiently, the unit being worked on (its gathered parameters in stage 3, its gradient
// buffer while a scope is open and until its reduction has completed), and in stage 3 the units
// the scheduler gathered ahead or kept, within max_live_elements.
//
// Equivalence: every stage reduces each micro-step's unit gradients with the communicator's
// rank-order average and accumulates the result in fp32 in micro-step order, computes the
// global gradient norm from per-shard partial sums added in rank order, and runs the same
// elementwise Adam; so all stages give bit-identical parameters for the same world size.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/core/dtype.h"
#include "zinf/core/status.h"
#include "zinf/core/tunables.h"
#include "zinf/engine/budgets.h"
#include "zinf/kernels/adam_math.h"
#include "zinf/memory/accounting.h"
#include "zinf/memory/device.h"
#include "zinf/store/tiered_store.h"
#include "zinf/zero/shard_layout.h"

namespace zinf {

struct EngineSettings {
  // Every default below names its entry in the table of tunables (zinf/core/tunables.h), which
  // says where it comes from (DeepSpeed's default wherever DeepSpeed has the key); no default is
  // written here. tests/settings checks that EngineSettings{}, the config reader and `zinf train`
  // agree; a new field needs a table entry and its line in engine_fields()
  // (zinf/engine/settings.h).

  // The tier a table offload device ("none", "cpu", "nvme") stands for: "none" is the device.
  static constexpr Tier home_tier(std::string_view offload_device) {
    return offload_device == "nvme"  ? Tier::kNvme
           : offload_device == "cpu" ? Tier::kHost
                                     : Tier::kDevice;
  }
  // The other way round: the device a home tier is named by in the table.
  static constexpr std::string_view home_name(Tier home) {
    return home == Tier::kNvme ? "nvme" : home == Tier::kHost ? "cpu" : "none";
  }

  int stage = tunables::kStage.value;    // ZeRO stage 0..3
  DType dtype = tunables::kDtype.value;  // working parameters and gradients
  int gradient_accumulation_steps = tunables::kGradientAccumulationSteps.value;
  float gradient_clipping = tunables::kGradientClipping.value;  // global-norm clipping; 0 = off
  // AdamW by default (decoupled weight decay)
  kernels::AdamConfig adam{.lr = tunables::kLr.value,
                           .beta1 = tunables::kBeta1.value,
                           .beta2 = tunables::kBeta2.value,
                           .eps = tunables::kEps.value,
                           .weight_decay = tunables::kWeightDecay.value,
                           .weight_decay_mode = tunables::kAdamWMode.value
                                                    ? kernels::WeightDecayMode::kDecoupled
                                                    : kernels::WeightDecayMode::kL2,
                           .bias_correction = tunables::kBiasCorrection.value};
  // fp16 dynamic loss scaling (as DeepSpeed): skip the step and lower the scale on overflow.
  float static_loss_scale = tunables::kStaticLossScale.value;  // > 0: a fixed scale; 0: dynamic
  int initial_scale_power = tunables::kInitialScalePower.value;
  int loss_scale_window = tunables::kLossScaleWindow.value;
  int hysteresis = tunables::kHysteresis.value;
  float min_loss_scale = tunables::kMinLossScale.value;
  // Every precision skips a step whose global gradient norm is not finite (the gradients are
  // dropped, the parameters and optimizer state stay bit for bit) and counts it; this many skips
  // in a row (fp16 with dynamic scaling: counted only at min_loss_scale) make step() fail with an
  // error naming the step. 0 = skip without limit. Not with overlap_optimizer's early updates,
  // which start before the norm is known, except that with one rank a non-finite gradient met by
  // the step's first update (before any other) skips the step and counts the same way.
  uint64_t max_nonfinite_steps = tunables::kMaxNonfiniteSteps.value;
  uint64_t reduce_bucket_elements = tunables::kReduceBucket.value;  // reduce_bucket_size
  // Leave reductions in flight across scopes. The config reader turns it on for stage 3 when the
  // key is absent (DeepSpeed's rule); here it is the default stage's value.
  bool overlap_comm = tunables::kOverlapComm.value;
  // Placement: where parameters and optimizer state live (the offload work sets these).
  Tier param_home = home_tier(tunables::kParamHome.value);
  Tier optimizer_home = home_tier(tunables::kOptimizerHome.value);
  // Share of parameters whose optimizer state is offloaded.
  double optimizer_offload_ratio = tunables::kOptimizerOffloadRatio.value;
  std::vector<std::string> nvme_paths;  // none by default (tunables::kNvmePaths)
  // Byte budgets per rank: device, and host (pinned when pin_memory). 0 = auto (fit the
  // machine, docs/engine.md).
  uint64_t device_mem = tunables::kDeviceMem.value;
  uint64_t host_mem = tunables::kHostMem.value;
  // offload_param.max_in_cpu: parameter elements of NVMe-homed state cached in host memory when
  // the host budget is chosen automatically (host_mem 0).
  uint64_t param_max_in_cpu = tunables::kParamMaxInCpu.value;
  // NVMe <-> device staging piece (multiple of 1 MiB)
  uint64_t staging_bytes = tunables::kStagingBytes.value;
  uint32_t staging_buffers = tunables::kStagingBuffers.value;  // staging pieces in flight per move
  // The scheduler (stage 3; sizes in parameter elements, as DeepSpeed's keys). From the second
  // step on, units are all-gathered ahead of use along the recorded order while the elements
  // ahead stay below prefetch_bucket_elements (stage3_prefetch_bucket_size; 0 = none), and their
  // shards are read from host or NVMe twice as far ahead. Units gathered at once (in use,
  // fetched ahead or kept) stay within max_live_elements (stage3_max_live_parameters), and within
  // what fits in the device budget beside the unit being worked on (budgets.h). A unit whose
  // next use in the step comes within max_reuse_distance elements stays gathered
  // (stage3_max_reuse_distance; 0 = never).
  uint64_t prefetch_bucket_elements = tunables::kPrefetchBucket.value;
  uint64_t max_live_elements = tunables::kMaxLive.value;
  uint64_t max_reuse_distance = tunables::kMaxReuseDistance.value;
  // Stage 3: units of at most this many parameters stay gathered on the device and are
  // all-gathered once per step instead of at every use (stage3_param_persistence_threshold).
  uint64_t param_persistence_threshold = tunables::kParamPersistenceThreshold.value;
  // Optimizer sub-groups (sub_group_size, elements): each rank's optimizer state is cut into
  // pieces of at most this many elements, packed into groups the optimizer walks as a pipeline
  // (read group i+1, update group i, write back group i-1). With the optimizer offloaded and a
  // host budget, groups are also capped at a third of what the budget holds. 0 = one per unit.
  uint64_t sub_group_elements = tunables::kSubGroup.value;
  // Start a unit's optimizer update as soon as its gradients are final in a step (its last use in
  // the recorded order has been reduced), overlapping the rest of the backward pass. Only when
  // nothing needs every gradient first: no clipping, no fp16 overflow check. Requires every step
  // to use the units in the recorded order: gathering a unit again after its update started is
  // an error.
  bool overlap_optimizer = tunables::kOverlapOptimizer.value;
  // With one rank, stage 3 and the optimizer offloaded (and no overlap_optimizer updates):
  // step() returns once the gradient norm is known, and the update walk runs on while the next
  // forward pass uses the units it has updated (Engine::step()).
  bool update_behind = tunables::kUpdateBehind.value;
  bool checksum = tunables::kChecksum.value;  // XXH3 per swapped 1 MiB block, verified on read
  uint32_t io_queue_depth = tunables::kIoQueueDepth.value;  // aio.queue_depth
  uint64_t io_block_size = tunables::kIoBlockSize.value;    // aio.block_size
  uint32_t io_rings = tunables::kIoRings.value;             // aio.intra_op_parallelism
  bool io_single_submit = tunables::kIoSingleSubmit.value;  // aio.single_submit
  bool io_fixed_buffers = tunables::kIoFixedBuffers.value;  // zinf.io_fixed_buffers
  bool pin_memory = tunables::kPinMemory.value;  // host tier page-locked (offload_*.pin_memory)
  // The optimizer pipeline (offload_optimizer.pipeline_read / pipeline_write): read the next
  // sub-group's state while one is updated (and the first groups' during the backward pass),
  // and write an updated group back while the next is updated. Off: each waits its turn.
  bool pipeline_read = tunables::kPipelineRead.value;
  bool pipeline_write = tunables::kPipelineWrite.value;
  int optimizer_threads = tunables::kOptimizerThreads.value;  // CPU Adam threads; 0 = all
  // The device of the top tier: the CPU device, its strict variant (tests), or CUDA; kAuto reads
  // $ZINF_DEVICE (cpu, cpu-strict, cuda) and defaults to cuda where a GPU is visible, else cpu.
  DeviceKind device = parse_device_kind(tunables::kDevice.value).value();
  // CUDA: the GPU of this rank; -1 = $LOCAL_RANK modulo the visible GPUs (cuda_ordinal).
  int device_ordinal = tunables::kDeviceOrdinal.value;
  uint64_t seed = tunables::kSeed.value;
};

// Initial value of element `element` (index in the unit's flat buffer) of unit `unit`.
using InitFn = std::function<float(size_t unit, uint64_t element, uint64_t seed)>;

class Engine;

// A typed span of device memory. Host code never dereferences `data` (on the strict CPU device it
// faults): pass it to the device's operations (Engine::device()).
template <typename T>
struct DeviceSpan {
  T* data = nullptr;
  uint64_t size = 0;  // elements
};

// A unit's flat buffer on the device, with its element type. as<T>() with the wrong T is an
// error naming both types, never a reinterpretation.
class TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, DType dtype, uint64_t numel, std::string what)
      : data_(data), dtype_(dtype), numel_(numel), what_(std::move(what)) {}
  DType dtype() const { return dtype_; }
  uint64_t numel() const { return numel_; }
  TensorRef ref() const { return {.data = data_, .dtype = dtype_, .numel = numel_}; }
  template <typename T>
  Result<DeviceSpan<T>> as() const {
    if (element_dtype<T> != dtype_) {
      return make_error(ErrorCode::kInvalidArgument, "{} holds {} elements, asked for {}", what_,
                        dtype_name(dtype_), dtype_name(element_dtype<T>));
    }
    return DeviceSpan<T>{.data = static_cast<T*>(data_), .size = numel_};
  }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  uint64_t numel_ = 0;
  std::string what_;
};

// A unit's parameters gathered on the device for the duration of a scope.
class UnitScope {
 public:
  UnitScope() = default;
  UnitScope(UnitScope&& o) noexcept { *this = std::move(o); }
  UnitScope& operator=(UnitScope&& o) noexcept;
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;
  ~UnitScope();

  size_t unit() const { return unit_; }
  const zero::ShardLayout& layout() const;
  // The unit's full flat parameters on the device (working dtype, numel_padded elements).
  TensorView params() const;
  // The unit's full flat gradient buffer on the device (working dtype, numel_padded elements),
  // zero the first time it is asked for in this scope. Accumulate into it (device operations);
  // it is reduced into the owning shards at scope end.
  Result<TensorView> grads();

  // For a model that computes on the host: the first layout().numel parameters converted to fp32
  // into `out` (at least that long), through the device's operations.
  Status params_to_host(std::span<float> out) const;
  // The unit's gradients from the host: `in` (layout().numel fp32 values) converted to the
  // working dtype into grads(), replacing what it held (16-bit gradients for bf16/fp16).
  Status grads_from_host(std::span<const float> in);
  // The same for a model that computes on the device itself (the GPT's GpuModel on CUDA): `out`
  // and `in` are fp32 buffers in memory the device's kernels reach (its own, or the model's
  // device allocations), at least layout().numel long.
  Status params_to_device(DeviceSpan<float> out) const;
  Status grads_from_device(DeviceSpan<const float> in);

  // For a model that computes on the host, in place of the copies above where the device allows
  // it: the working dtype is fp32 and the device's memory is host memory (Device::host_window;
  // the CPU device). The unit's parameters (read only; layout().numel of them) and its gradient
  // buffer (zero the first time it is asked for; the model writes the unit's gradients there),
  // reachable by host code until the scope ends, with no copy. nullptr, not an error, where the
  // device declines (CUDA) or the parameters are 16-bit, and from grads_in_place where the
  // gradient buffer does not fit in the device budget yet: the model copies instead, for the rest
  // of the scope (grads_from_host overwrites the buffer: gradients written in place before it are
  // lost).
  Result<const float*> params_in_place();
  Result<float*> grads_in_place();

  // Ends the scope now and reports what failed (the destructor can only record it).
  Status finish();

 private:
  Status params_to_f32(void* out, uint64_t size, const char* caller) const;
  Status grads_from_f32(const void* in, uint64_t size, const char* caller);
  friend class Engine;
  Engine* engine_ = nullptr;
  size_t unit_ = 0;
  void* params_ = nullptr;     // device memory
  TensorHandle param_handle_;  // stages 0-2: the resident full parameters
  DeviceBuffer grads_;
  // Open while the model reaches params_ / grads_ in place (params_in_place, grads_in_place).
  std::optional<Device::CommWindow> params_window_, grads_window_;
  std::chrono::steady_clock::time_point opened_;  // for the trace
};

struct StepInfo {
  int64_t step = 0;           // optimizer steps taken
  bool skipped = false;       // a non-finite gradient norm (fp16: an overflow): no update this step
  int64_t skipped_steps = 0;  // steps skipped so far for a non-finite gradient norm
  uint64_t nonfinite_in_a_row = 0;  // the skips counting towards max_nonfinite_steps
  double grad_norm = 0;  // global norm of the (unscaled, averaged) gradients; 0 when not needed
  float loss_scale = 1;
  // Units whose update started during the backward pass (overlap_optimizer).
  size_t units_updated_early = 0;
};

// What the scheduler did over the last step.
struct ScheduleReport {
  bool following = false;           // the step followed a recorded order
  uint64_t departures = 0;          // departures from the recorded order so far
  uint64_t gathers_on_demand = 0;   // uses that issued their all-gather themselves
  uint64_t gathers_ahead = 0;       // all-gathers issued ahead of their use
  uint64_t uses_served_ahead = 0;   // uses whose all-gather had been issued ahead
  uint64_t uses_served_kept = 0;    // uses of a unit kept gathered since an earlier use
  uint64_t peak_live_elements = 0;  // most parameter elements gathered at once
  size_t sub_groups = 0;            // optimizer sub-groups
};

struct MemoryReport {
  TierUsage tiers[kNumTiers];
};

// The least NVMe traffic one optimizer step of one rank must move with a placement (bytes read
// and written; docs/offload.md, "The traffic minimum"). `param_elements`: the rank's parameter
// elements homed on NVMe (its stage-3 shards; 0 when the parameters are not there), of which
// `persistent_param_elements` belong to persistent units (stage3_param_persistence_threshold:
// gathered once per step and kept, so read once);
// `optimizer_elements`: the elements whose optimizer state (Adam m and v, and the fp32 master in
// mixed precision) the rank holds on NVMe. Gradients are counted as kept in memory (a gradient
// that must wait on disk for the norm adds its own write and read); with no clipping and not
// fp16, the update is counted as fused into the backward pass, so that an fp32 parameter read
// for the backward gather is also the master the update reads; with `update_behind` the update
// after the backward pass leaves the parameters in memory for the next forward pass, so in fp32
// its read of the master is that pass's read.
//
// `gradient_spill_bytes` is what the host budget adds: the gradient accumulators of that state
// live in host memory (where the CPU Adam reads them), and when every gradient must be final
// before any update (clipping, fp16's overflow check, or several micro-steps to accumulate) the
// accumulators beyond the budget's room (`accumulator_bytes` over `host_room_bytes`: the budget
// less its staging buffers and the state homed there) must wait on NVMe: one more write and read
// each, at every wait. A step of g micro-steps waits g times (after each micro-step's backward
// pass; the last one's wait is for the norm) or, when its update could be fused, g - 1 times
// (the last micro-step's gradients go straight to the update). A step at these budgets moves at
// least read_bytes and written_bytes plus that.
struct NvmeTrafficInputs {
  uint64_t param_elements = 0;
  uint64_t persistent_param_elements = 0;  // (part of param_elements)
  uint64_t optimizer_elements = 0;
  DType dtype = DType::kF32;
  int gradient_accumulation_steps = 1;
  bool clipping = true;            // gradient_clipping > 0: every norm is known before any update
  bool update_behind = false;      // the update runs behind step() (EngineSettings::update_behind)
  uint64_t accumulator_bytes = 0;  // host-held gradient accumulators of the state on NVMe
  uint64_t host_room_bytes = UINT64_MAX;  // what the host budget can give them
};
struct NvmeTraffic {
  uint64_t read_bytes = 0;            // gradients counted as kept in memory
  uint64_t written_bytes = 0;         // (the same)
  uint64_t gradient_spill_bytes = 0;  // accumulators the host budget cannot keep, each way, x waits
};
NvmeTraffic nvme_traffic_minimum(const NvmeTrafficInputs& in);

struct CommReport {
  // Elements of the full buffers each rank took part in during the last step (ZeRO volumes).
  uint64_t param_gather_elements = 0;  // all-gathers of parameters
  uint64_t grad_reduce_elements = 0;   // reduce-scatters (P) or all-reduces (2P) of gradients
  uint64_t control_elements = 0;       // norm partials (bytes), the step agreement flags
  uint64_t volume_elements() const { return param_gather_elements + grad_reduce_elements; }
  comm::CommCounters counters;  // the communicator's counters over the last step
};

// Checkpoints (docs/checkpoints.md; the format is zinf/ckpt/manifest.h).
struct SaveCheckpointOptions {
  int64_t step = -1;  // the directory's label, step-<step>; -1: the optimizer steps taken
  int keep = 0;       // after a successful save keep the newest `keep` checkpoints; 0 = all
  // The caller's own state (data position, seeds, a learning-rate schedule), a JSON object
  // stored in the manifest as "user" and given back by load_checkpoint().
  std::string user_state = "{}";
};

struct LoadedCheckpoint {
  std::string path;  // the step directory loaded
  int64_t step = 0;  // its label
  int64_t optimizer_steps = 0;
  std::string user_state;  // SaveCheckpointOptions::user_state as saved
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(const EngineSettings& settings,
                                                comm::Communicator& comm,
                                                std::vector<zero::UnitSpec> units, InitFn init);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Result<UnitScope> gather(size_t unit);
  // Applies the optimizer to the gradients accumulated since the last step. With update_behind
  // in force (EngineSettings::update_behind) it returns once the gradient norm is known and the
  // update runs on while the next pass begins: that pass's gather of a unit waits for the unit's
  // own update. A failure of such an update is returned by the gather (or call) that meets it,
  // and leaves the step incomplete as a failed step() does: call step() again to finish it (the
  // gradients of the pass begun since are dropped: run its micro-steps again).
  Status step();
  // Waits for an update left running by step() (update_behind); step(), gather(), the checkpoint
  // calls and full_parameters() wait for what they need themselves.
  Status wait_for_update();
  // The store's counters at the end of each step's update, and when it ended (the last 8, oldest
  // first, numbered from 1): a step's NVMe bytes are its entry's minus the one before, and its
  // time runs from the one before. Each step() call adds one entry when its update ends: before
  // it returns, or with update_behind when a later call waits for the update.
  struct UpdateEnd {
    uint64_t index = 0;
    StoreStats stats;
    std::chrono::steady_clock::time_point at;
  };
  std::vector<UpdateEnd> update_ends() const;

  // The optimizer's hyperparameters for the next step() (a learning-rate schedule sets them
  // between steps: zinf/optim/lr_schedule.h). Every rank must set the same values, as for every
  // other setting. Call them after step() and before the next step's first gather: with
  // overlap_optimizer a unit's update may start during the backward pass, and once one has
  // started in a step they are refused (an error) until step(). settings().adam shows the values
  // in force. set_lr: a finite number >= 0; set_betas: two numbers in [0, 1).
  Status set_lr(float lr);
  Status set_betas(float beta1, float beta2);

  // Multiply the loss by this before backward (fp16 loss scaling; 1 otherwise).
  float loss_scale() const;
  const StepInfo& last_step() const { return last_step_; }
  MemoryReport memory_report() const;
  // nvme_traffic_minimum() for this rank's placement, settings and host budget: what a step must
  // move at least, to hold store_stats()' per-step NVMe bytes against.
  NvmeTraffic nvme_traffic_minimum() const;
  // What the tiered store moved so far (NVMe bytes read and written, evictions, ...).
  StoreStats store_stats() const;
  CommReport comm_report() const { return last_comm_; }
  ScheduleReport schedule_report() const { return last_schedule_; }
  // Collective: every rank must call it. The unit's fp32 parameters (the master copy), whole.
  Result<std::vector<float>> full_parameters(size_t unit);

  // Collective, between steps (no scope open). Every rank writes its shards of the working
  // parameters, the fp32 master (mixed precision) and Adam m and v, streamed tensor by tensor
  // through the host tier (state on NVMe is never loaded whole), under root/tmp-<step>-<pid>;
  // rank 0 then writes the manifest (with the optimizer step, the loss scale and its counters,
  // the caller's state, every file's size and XXH3) and commits it atomically as
  // root/step-<step>, pointed to by root/latest (zinf/ckpt/directory.h). A failure on any rank
  // fails every rank and leaves the previous checkpoints as they were. Returns the directory.
  Result<std::string> save_checkpoint(const std::string& root,
                                      const SaveCheckpointOptions& options = {});
  // Collective, between steps. `path`: a step directory, or a root whose `latest` names one.
  // Verifies the manifest against this engine's units and every file it reads (size, XXH3)
  // before anything is overwritten; a corrupt or truncated file is refused, named. Loads at any
  // world size and stage (each element found by its flat index in the saved segments); the
  // working dtype must be the saved one.
  Result<LoadedCheckpoint> load_checkpoint(const std::string& path);

  size_t unit_count() const;
  const zero::ShardLayout& layout(size_t unit) const;
  const zero::UnitSpec& unit_spec(size_t unit) const;
  // The effective settings: those given, with automatic budgets (device_mem, host_mem 0)
  // replaced by the ones chosen.
  const EngineSettings& settings() const { return settings_; }
  // The budgets this rank runs with and how they were chosen (zinf/engine/budgets.h).
  const Budgets& budgets() const;
  // The device the engine computes on, and the stream its operations run on. A model may run its
  // own operations on gathered parameters and gradients there.
  Device& device() const;
  Stream& stream() const;
  int rank() const;
  int world_size() const;

  struct Impl;

 private:
  friend class UnitScope;
  Engine(const EngineSettings& settings, std::unique_ptr<Impl> impl);
  Status end_scope(UnitScope& scope);
  Result<TensorView> scope_grads(UnitScope& scope);
  // The scope's gradient buffer allocated and zeroed, if it has none (kOutOfMemory, and nothing
  // changed, when it does not fit).
  Status allocate_scope_grads(UnitScope& scope);

  EngineSettings settings_;
  std::unique_ptr<Impl> impl_;
  StepInfo last_step_;
  CommReport last_comm_;
  ScheduleReport last_schedule_;
};

}  // namespace zinf
