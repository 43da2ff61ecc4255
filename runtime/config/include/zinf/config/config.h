// The training configuration: DeepSpeed's JSON format, so a DeepSpeed user brings their config
// file unchanged, plus an optional "zinf" block for what DeepSpeed has no key for.
//
// Every default below is taken from the table of tunables (zinf/core/tunables.h), which states
// where each comes from (DeepSpeed's documented default wherever DeepSpeed has the key); no
// default is written here. docs/configuration.md is the user-facing reference.
//
// DeepSpeed keys that zinf accepts but does not act on (accepted_but_ignored_keys()) have no
// field: their type is checked, nothing else, and parsing logs ONE warning naming those the
// config sets (Config::ignored_keys).
//
// Units: DeepSpeed's ZeRO "sizes" (bucket sizes, thresholds, offload buffer sizes) are numbers of
// parameter ELEMENTS, not bytes; only aio.block_size and the zinf block are in bytes.
//
// Reading a config:
//   ZINF_ASSIGN_OR_RETURN(config::Config cfg, config::load_config(path));  // types, ranges, combos
//   ZINF_RETURN_IF_ERROR(config::resolve_batch_sizes(cfg, world_size));     // needs the world
//   config::log_effective_config(cfg);                                       // once, at start-up
// Every error names the JSON path of the offending key ("zero_optimization.offload_param.device")
// and what was expected. Unknown keys are not errors: parsing logs ONE warning naming all of them
// and lists them in Config::unknown_keys.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"
#include "zinf/core/tunables.h"

namespace zinf::config {

// Where offloaded state lives. JSON: "none" | "cpu" | "nvme".
enum class OffloadDevice { kNone, kCpu, kNvme };

std::string_view offload_device_name(OffloadDevice d);
// Exact (lower-case) names; the reader lower-cases what the file says first.
constexpr std::optional<OffloadDevice> parse_offload_device(std::string_view name) {
  if (name == "none") return OffloadDevice::kNone;
  if (name == "cpu") return OffloadDevice::kCpu;
  if (name == "nvme") return OffloadDevice::kNvme;
  return std::nullopt;
}

// One of zero_optimization.offload_param / zero_optimization.offload_optimizer. The two DeepSpeed
// blocks share this struct; each block accepts only the keys DeepSpeed defines for it (marked
// below), and the fields that do not apply to a block stay at their defaults.
struct OffloadConfig {
  // both blocks; "none"
  OffloadDevice device = *parse_offload_device(tunables::kOptimizerHome.value);
  // both blocks. DeepSpeed takes one directory; zinf also takes a list of directories and
  // stripes the swap files across them. Required (non-empty) when device is kNvme.
  std::vector<std::string> nvme_path;
  // both blocks: buffers in the NVMe staging pool (EngineSettings::staging_buffers). DeepSpeed:
  // 5 for offload_param (ZeroConfig sets it), 4 for offload_optimizer.
  int64_t buffer_count = tunables::kStagingBuffers.value;
  // offload_param only: with NVMe offload, the parameter elements of cache the automatic host
  // budget holds (docs/engine.md, Budgets).
  uint64_t max_in_cpu = tunables::kParamMaxInCpu.value;
  bool pin_memory = tunables::kPinMemory.value;  // both blocks: page-locked host memory
  // offload_optimizer only: read sub-group i+1 during the update of i.
  bool pipeline_read = tunables::kPipelineRead.value;
  // offload_optimizer only: write i-1 back during the update of i.
  bool pipeline_write = tunables::kPipelineWrite.value;
  // offload_optimizer only: fraction of the optimizer state offloaded (and updated by the CPU);
  // the rest stays on the device (DeepSpeed's partial offload, "Twin-Flow"). (0, 1]; below 1
  // only with stage 3, as DeepSpeed.
  double ratio = tunables::kOptimizerOffloadRatio.value;

  bool enabled() const { return device != OffloadDevice::kNone; }
  bool operator==(const OffloadConfig&) const = default;
};

// The top-level "aio" block: DeepSpeed's asynchronous I/O settings, mapped onto zinf's io_uring
// IoEngine (see docs/configuration.md for the mapping).
struct AioConfig {
  uint64_t block_size = tunables::kIoBlockSize.value;  // bytes per I/O request; a multiple of 4096
  int queue_depth = static_cast<int>(tunables::kIoQueueDepth.value);  // requests in flight/ring
  // Threads (io_uring rings) that split one large transfer. DeepSpeed before 0.15 called this key
  // "thread_count"; both names are accepted.
  int intra_op_parallelism = static_cast<int>(tunables::kIoRings.value);
  // Submit requests one at a time instead of in batches.
  bool single_submit = tunables::kIoSingleSubmit.value;

  bool operator==(const AioConfig&) const = default;
};

// The "zero_optimization" block. Sizes are in parameter elements.
struct ZeroConfig {
  int stage = tunables::kStage.value;  // 0 (plain data parallel) .. 3
  // Reductions overlap the backward pass. DeepSpeed's default depends on the stage: true for
  // stage 3, false otherwise; parse_config applies that rule when the key is absent.
  bool overlap_comm = tunables::kOverlapComm.value;
  uint64_t reduce_bucket_size = tunables::kReduceBucket.value;  // elements reduced at once
  // Optimizer sub-group ("tile") size for offloaded updates, in elements; 0 = one sub-group per
  // parameter unit.
  uint64_t sub_group_size = tunables::kSubGroup.value;
  // Stage 3 (each key also accepted without the "stage3_" prefix, as DeepSpeed does):
  // elements fetched ahead; 0 = none
  uint64_t stage3_prefetch_bucket_size = tunables::kPrefetchBucket.value;
  // units with at most this many parameters stay gathered
  uint64_t stage3_param_persistence_threshold = tunables::kParamPersistenceThreshold.value;
  uint64_t stage3_max_live_parameters = tunables::kMaxLive.value;          // live gathered elements
  uint64_t stage3_max_reuse_distance = tunables::kMaxReuseDistance.value;  // kept if reused within
  OffloadConfig offload_param{.device = *parse_offload_device(tunables::kParamHome.value),
                              .buffer_count = tunables::kParamBufferCount.value};  // stage 3 only
  OffloadConfig offload_optimizer;                                                 // stage 1..3

  bool operator==(const ZeroConfig&) const = default;
};

// The "optimizer" block. Type names are matched case-insensitively, as DeepSpeed does.
//
// Weight decay, as DeepSpeed (FusedAdam / DeepSpeedCPUAdam) and PyTorch apply it:
//  - decoupled (AdamW, Loshchilov & Hutter): p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p),
//    the same as torch.optim.AdamW's p *= 1 - lr * wd before the Adam update;
//  - L2 (classic Adam, torch.optim.Adam(weight_decay=wd)): g += wd * p before the moments.
// type "AdamW" is always decoupled. type "Adam" is decoupled too unless params.adam_w_mode is
// false: DeepSpeed's adam_w_mode defaults to true, so a DeepSpeed "Adam" with weight_decay > 0
// is AdamW unless the config says "adam_w_mode": false.
struct OptimizerConfig {
  enum class Type { kAdam, kAdamW };
  // When the config has no "optimizer" block (DeepSpeed then uses the client's optimizer), zinf
  // uses Adam with DeepSpeed FusedAdam's defaults.
  Type type = tunables::kOptimizerType.value == "AdamW" ? Type::kAdamW : Type::kAdam;
  float lr = tunables::kLr.value;                     // >= 0
  float beta1 = tunables::kBeta1.value;               // params.betas[0], in [0, 1)
  float beta2 = tunables::kBeta2.value;               // params.betas[1], in [0, 1)
  float eps = tunables::kEps.value;                   // > 0; added to the bias-corrected sqrt(v)
  float weight_decay = tunables::kWeightDecay.value;  // >= 0
  // effective: true = decoupled decay, false = L2 (see above)
  bool adam_w_mode = tunables::kAdamWMode.value;
  bool bias_correction = tunables::kBiasCorrection.value;

  bool operator==(const OptimizerConfig&) const = default;
};

std::string_view optimizer_type_name(OptimizerConfig::Type t);

// The "scheduler" block: DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py),
// with DeepSpeed's type names (matched exactly, as DeepSpeed looks them up), parameter names and
// defaults. zinf/optim/lr_schedule.h computes them; docs/configuration.md shows the formulas.
// Each type accepts only its own parameters (DeepSpeed passes them to the class's constructor, so
// another type's parameter is an error there too). A parameter left out takes DeepSpeed's default;
// those without one (std::nullopt below) are required by the types that use them, except that
// "auto" leaves them to the trainer (`zinf train` resolves them from the run) and a schedule built
// with one still missing is an error naming the key.
struct SchedulerConfig {
  // kNone: no "scheduler" block; the optimizer runs at optimizer.params.lr throughout.
  enum class Type { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle };
  enum class WarmupType { kLog, kLinear };

  Type type = Type::kNone;  // tunables::kLrSchedule (checked below)
  // WarmupLR, WarmupDecayLR: lr from warmup_min_lr to warmup_max_lr over the warm-up.
  double warmup_min_lr = 0.0;
  // WarmupLR: absent = optimizer.params.lr; WarmupDecayLR: absent = 0.001 (DeepSpeed's defaults).
  std::optional<double> warmup_max_lr;
  // WarmupLR, WarmupDecayLR, WarmupCosineLR: steps of warm-up (> 0; DeepSpeed uses max(2, n)).
  int64_t warmup_num_steps = tunables::kWarmupSteps.value;
  WarmupType warmup_type = WarmupType::kLog;  // "log" | "linear"
  std::optional<int64_t> total_num_steps;     // WarmupDecayLR, WarmupCosineLR: required, >= 1
  // WarmupCosineLR: ratios of optimizer.params.lr.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle (cycle_min_lr and cycle_max_lr are required).
  std::optional<double> cycle_min_lr;
  std::optional<double> cycle_max_lr;
  double decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000;              // > 0
  std::optional<double> cycle_second_step_size;     // >= 0; absent = cycle_first_step_size
  int64_t cycle_first_stair_count = 0;              // >= 0; 0 = no staircase
  std::optional<int64_t> cycle_second_stair_count;  // absent = cycle_first_stair_count
  double decay_step_size = 0;                       // >= 0; 0 = no decay after the cycle
  // Momentum cycling sets Adam's betas to (momentum, 0.99), as DeepSpeed does (its beta2 is 0.99
  // while cycling, whatever optimizer.params.betas says).
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;

  bool operator==(const SchedulerConfig&) const = default;
};

// DeepSpeed's names: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"; "none" for kNone.
constexpr std::string_view scheduler_type_name(SchedulerConfig::Type t) {
  switch (t) {
    case SchedulerConfig::Type::kNone:
      return "none";
    case SchedulerConfig::Type::kWarmupLR:
      return "WarmupLR";
    case SchedulerConfig::Type::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerConfig::Type::kWarmupCosineLR:
      return "WarmupCosineLR";
    case SchedulerConfig::Type::kOneCycle:
      return "OneCycle";
  }
  return "none";
}
// Exact names (as DeepSpeed); "none" too (the CLI's --lr-schedule none).
constexpr std::optional<SchedulerConfig::Type> parse_scheduler_type(std::string_view name) {
  using T = SchedulerConfig::Type;
  for (T t : {T::kNone, T::kWarmupLR, T::kWarmupDecayLR, T::kWarmupCosineLR, T::kOneCycle}) {
    if (name == scheduler_type_name(t)) return t;
  }
  return std::nullopt;
}
static_assert(scheduler_type_name(SchedulerConfig{}.type) == tunables::kLrSchedule.value);
// The parameters (DeepSpeed's names) a type accepts.
std::span<const std::string_view> scheduler_params(SchedulerConfig::Type t);

// The "fp16" block: fp16 working precision with (by default dynamic) loss scaling.
struct Fp16Config {
  bool enabled = tunables::kDtype.value == DType::kF16;
  float loss_scale = tunables::kStaticLossScale.value;  // 0 = dynamic scaling; > 0 = fixed
  // dynamic: the first scale is 2^initial_scale_power
  int initial_scale_power = tunables::kInitialScalePower.value;
  // dynamic: steps without overflow before the scale doubles
  int loss_scale_window = tunables::kLossScaleWindow.value;
  int hysteresis = tunables::kHysteresis.value;  // dynamic: overflows before the scale halves
  float min_loss_scale = tunables::kMinLossScale.value;  // dynamic: the scale's floor

  bool operator==(const Fp16Config&) const = default;
};

// The "zinf" block: zinf's own settings, which DeepSpeed has no key for. Byte values accept
// integers or strings such as "4G" or "512MiB" (binary multiples).
struct ZinfConfig {
  // Byte budgets per rank; 0 = auto (fit the machine, docs/engine.md). In JSON, leave the key out
  // for auto: an explicit 0 is an error.
  uint64_t device_mem = tunables::kDeviceMem.value;
  uint64_t host_mem = tunables::kHostMem.value;
  // Chrome/Perfetto trace file to write; "" = no trace
  std::string trace = std::string(tunables::kTrace.value);
  uint64_t seed = tunables::kSeed.value;      // parameter initialisation seed
  bool checksum = tunables::kChecksum.value;  // XXH3 per swapped extent, verified on read
  uint64_t staging_bytes = tunables::kStagingBytes.value;  // NVMe <-> device piece; k * 1 MiB
  // Start each unit's optimizer update during the backward pass once its gradients are final
  // (EngineSettings::overlap_optimizer).
  bool overlap_optimizer = tunables::kOverlapOptimizer.value;
  // step() leaves the update running under the next forward pass (EngineSettings::update_behind).
  bool update_behind = tunables::kUpdateBehind.value;
  int optimizer_threads = tunables::kOptimizerThreads.value;  // CPU Adam threads; 0 = all cores
  bool io_fixed_buffers = tunables::kIoFixedBuffers.value;    // registered io_uring buffers
  // Non-finite gradient norms in a row before a step fails (EngineSettings::max_nonfinite_steps).
  uint64_t max_nonfinite_steps = tunables::kMaxNonfiniteSteps.value;

  bool operator==(const ZinfConfig&) const = default;
};

struct Config {
  // Batch sizes follow DeepSpeed: train_batch_size = micro * accumulation * world size, and any
  // one of the three may be left out and derived. 0 means "not given, derive it": parse_config
  // leaves train_batch_size at 0 when absent, and leaves the micro batch or the accumulation steps
  // at 0 when train_batch_size is given without them; resolve_batch_sizes() fills them in once
  // the world size is known. (DeepSpeed requires train_batch_size or the micro batch; zinf
  // defaults the micro batch to 1.)
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = tunables::kMicroBatch.value;
  int64_t gradient_accumulation_steps = tunables::kGradientAccumulationSteps.value;
  // global gradient-norm bound; 0 = no clipping
  float gradient_clipping = tunables::kGradientClipping.value;
  OptimizerConfig optimizer;
  Fp16Config fp16;
  // "bf16": {"enabled": ...} (also accepted as DeepSpeed's older "bfloat16")
  bool bf16 = tunables::kDtype.value == DType::kBF16;
  ZeroConfig zero;
  AioConfig aio;
  ZinfConfig zinf;
  SchedulerConfig scheduler;  // the "scheduler" block; type kNone when absent

  // Filled by parse_config, not part of the effective configuration (to_json leaves them out):
  std::vector<std::string> unknown_keys;  // JSON paths of keys zinf does not know, sorted
  // JSON paths given as "auto": left at their default (a schedule parameter without one: unset)
  // for the trainer to resolve from the run (`zinf train` does: docs/configuration.md, "auto").
  std::vector<std::string> auto_keys;
  // JSON paths of the accepted-but-ignored keys the config sets (accepted_but_ignored_keys()),
  // sorted; named in one warning.
  std::vector<std::string> ignored_keys;
  // JSON paths of every key the config gives a value (not null, not "auto"), sorted; a key given
  // under another name (an alias, a deprecated switch) is listed under its canonical path too.
  // `zinf train` uses it to tell what the config set from what it left at the default.
  std::vector<std::string> given_keys;

  // fp16 when fp16.enabled, bf16 when bf16, else fp32.
  DType working_dtype() const;

  bool operator==(const Config&) const = default;
};

// A DeepSpeed key that zinf accepts and does not act on: only its JSON type is checked.
struct IgnoredKey {
  enum class Type { kBool, kNumber, kString, kObject };
  std::string_view path;  // "zero_optimization.contiguous_gradients"
  Type type;
  std::string_view why;  // what zinf does instead (docs/configuration.md shows it)
};
std::span<const IgnoredKey> accepted_but_ignored_keys();

// Whether `c` sets the JSON key `path` (Config::given_keys).
bool config_sets(const Config& c, std::string_view path);

// Reads a parsed JSON document. Checks every key's type and range and the combinations that do
// not need the world size (fp16 with bf16, parameter offload below stage 3, ...). Logs one
// warning naming the unknown keys, if any, and one naming the accepted-but-ignored keys set.
// "zinf.device_mem": 0 and "zinf.host_mem": 0 are errors (leave the key out for auto budgets).
Result<Config> parse_config(const nlohmann::json& j);
// Parses JSON text first; a syntax error names the line and column.
Result<Config> parse_config_text(std::string_view text);
// Reads a file; a missing or unreadable file is named in the error.
Result<Config> load_config(const std::string& path);

// Checks the whole Config as parse_config does (useful for a Config built in code), plus what
// needs the world: the batch-size relation. Does not modify `c`.
Status validate(const Config& c, int world_size);
// validate(), then derives the batch sizes left at 0 as DeepSpeed does: micro batch =
// train_batch_size / (accumulation * world), accumulation = train_batch_size / (micro * world),
// train_batch_size = micro * accumulation * world.
Status resolve_batch_sizes(Config& c, int world_size);

// The effective configuration in DeepSpeed's format: parse_config(to_json(c)) == c, except for
// the parse notes (unknown_keys, auto_keys, ignored_keys, given_keys). Batch sizes left at 0
// ("derive") and budgets left at 0 ("auto") are left out.
nlohmann::json to_json(const Config& c);

// Logs every tunable once, one line per block (STYLE.md 11), and which keys were "auto".
void log_effective_config(const Config& c);

}  // namespace zinf::config
