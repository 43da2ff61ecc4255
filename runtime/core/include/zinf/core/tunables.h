// Every tunable of zinf, declared once (STYLE.md 11, as NCCL_PARAM declares NCCL's): its name,
// the DeepSpeed JSON key(s) that set it, the `zinf train` flag, its default, its unit and one line
// of doc. What the other parts take from an entry:
//   - EngineSettings (zinf/engine/engine.h) and the config reader's structs (zinf/config/config.h)
//     take their defaults from it; no other file writes a default;
//   - settings_json() (runtime/engine/src/settings.cc) writes every engine entry by name, from
//     the EngineSettings field its line in that file's field list names (a compile-time check
//     holds the list to the engine entries), and settings_from_config() sets that field from the
//     entry's JSON key where it has one;
//   - `zinf train` (cli/train_settings.cc) registers every `flag` with the doc, the JSON key and
//     the default as its help, sets the config field of the entry's JSON key from it (so a flag
//     means exactly what its key means), applies the `train` values, and names every entry not left
//     at its default in its start-up line (all of them with --show-settings and in --log-json);
//   - the rules that several readers apply (zinf/core/validate.h) name a setting by its JSON key
//     and flag.
// tests/settings checks that the engine, the config reader and `zinf train` agree, entry by entry.
//
// How a default is chosen: where DeepSpeed has the key, DeepSpeed's documented default
// (deepspeed/runtime/zero/config.py, offload_config.py, swap_tensor/aio_config.py, the fp16/bf16
// constants, FusedAdam's arguments); for settings only zinf has (the "zinf" JSON block and the
// engine-only ones), the engine's. An entry whose default is not the obvious one says why.
//
// `zinf train` is an example trainer with a recipe of its own: where `train` is set, the command
// uses that value unless a flag or the config file sets the key (so `zinf train` runs the same
// with and without a config that leaves the key out). The engine and the config reader never see
// these values.
//
// Adding a tunable: an entry here and its line in kAll below; then its use. An engine setting: a
// field in EngineSettings whose default names the entry, and that field's line in settings.cc's
// list (settings_json() and settings_from_config() then carry it). A JSON key: the config
// struct's field (its default names the entry), read in runtime/config and written by
// config::to_json(). A flag or a `train` value: the config field it sets, in
// cli/train_settings.cc's kConfigFields (its registration, help and start-up mark follow from the
// entry). A row in docs/configuration.md. tests/settings fails until the engine, the config
// reader and the CLI agree.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "zinf/core/dtype.h"

namespace zinf::tunables {

enum class Unit : uint8_t { kNone, kBytes, kElements, kSteps, kCount, kFraction };

constexpr std::string_view unit_name(Unit u) {
  switch (u) {
    case Unit::kNone:
      return "";
    case Unit::kBytes:
      return "bytes";
    case Unit::kElements:
      return "elements";
    case Unit::kSteps:
      return "steps";
    case Unit::kCount:
      return "count";
    case Unit::kFraction:
      return "fraction";
  }
  return "";
}

// Who reads the setting.
enum class Reader : uint8_t {
  kEngine,  // a field of EngineSettings named `name` (settings_json() has a key `name`)
  kConfig,  // only the config reader: it shapes how the config maps onto an engine field
  kTrain,   // `zinf train` (the example trainer), not the engine
};

template <class T>
struct Tunable {
  std::string_view name;  // the EngineSettings field ("adam.lr"), or the setting's own name
  T value;                // the default
  Unit unit = Unit::kNone;
  Reader reader = Reader::kEngine;
  std::string_view json;  // DeepSpeed JSON path(s) that set it, ", "-separated; "" = none
  std::string_view flag;  // the `zinf train` flag; "" = none
  std::string_view doc;   // one line
  std::optional<T> train = std::nullopt;  // `zinf train`'s own default, where it differs
  bool list = false;  // a list of values: the flag repeats, the JSON key takes one or a list
};

// ---- precision, batch, optimizer ----------------------------------------------------------------

inline constexpr Tunable<int> kStage{
    .name = "stage",
    .value = 0,
    .json = "zero_optimization.stage",
    .flag = "--stage",
    .doc = "ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters",
    .train = 3,  // the example shows ZeRO-3
};
inline constexpr Tunable<DType> kDtype{
    .name = "dtype",
    .value = DType::kF32,
    .json = "fp16.enabled, bf16.enabled",
    .flag = "--dtype",
    .doc = "working precision of parameters and gradients; fp32 master weights with bf16/fp16",
};
inline constexpr Tunable<int64_t> kMicroBatch{
    .name = "micro_batch",
    .value = 1,  // DeepSpeed requires the key or train_batch_size; zinf defaults it to 1
    .unit = Unit::kCount,
    .reader = Reader::kTrain,
    .json = "train_micro_batch_size_per_gpu",
    .flag = "--batch",
    .doc = "samples (sequences) per rank per micro-step",
    .train = 8,
};
inline constexpr Tunable<int> kGradientAccumulationSteps{
    .name = "gradient_accumulation_steps",
    .value = 1,
    .unit = Unit::kSteps,
    .json = "gradient_accumulation_steps",
    .flag = "--grad-accum",
    .doc = "micro-steps whose gradients add up before each optimizer step",
};
inline constexpr Tunable<float> kGradientClipping{
    .name = "gradient_clipping",
    .value = 0.0f,
    .json = "gradient_clipping",
    .flag = "--clip",
    .doc = "global gradient L2-norm bound; 0 = no clipping",
    .train = 1.0f,
};
inline constexpr Tunable<std::string_view> kOptimizerType{
    .name = "optimizer.type",
    .value = "Adam",  // DeepSpeed uses the client's optimizer; zinf's is Adam (FusedAdam's)
    .reader = Reader::kConfig,
    .json = "optimizer.type",
    .doc = "Adam or AdamW; decides adam.adam_w_mode with optimizer.params.adam_w_mode",
};
inline constexpr Tunable<float> kLr{
    .name = "adam.lr",
    .value = 1e-3f,
    .json = "optimizer.params.lr",
    .flag = "--lr",
    .doc = "learning rate; a schedule (lr_schedule) varies it from step to step",
    .train = 3e-3f,  // the GPT example learns within its few hundred steps
};
inline constexpr Tunable<std::string_view> kLrSchedule{
    .name = "lr_schedule",
    .value = "none",
    .reader = Reader::kTrain,
    .json = "scheduler.type",
    .flag = "--lr-schedule",
    .doc =
        "DeepSpeed's learning-rate schedule: none, WarmupLR, WarmupDecayLR, WarmupCosineLR, "
        "OneCycle (parameters in scheduler.params)",
};
inline constexpr Tunable<int64_t> kWarmupSteps{
    .name = "warmup_num_steps",
    .value = 1000,  // DeepSpeed's (WarmupLR, WarmupDecayLR, WarmupCosineLR)
    .unit = Unit::kSteps,
    .reader = Reader::kTrain,
    .json = "scheduler.params.warmup_num_steps",
    .flag = "--warmup-steps",
    .doc = "steps of learning-rate warm-up (the Warmup* schedules)",
};
inline constexpr Tunable<float> kBeta1{
    .name = "adam.beta1",
    .value = 0.9f,
    .json = "optimizer.params.betas",
    .doc = "first-moment decay rate (betas[0])",
};
inline constexpr Tunable<float> kBeta2{
    .name = "adam.beta2",
    .value = 0.999f,
    .json = "optimizer.params.betas",
    .doc = "second-moment decay rate (betas[1])",
};
inline constexpr Tunable<float> kEps{
    .name = "adam.eps",
    .value = 1e-8f,
    .json = "optimizer.params.eps",
    .doc = "added to the bias-corrected sqrt(v)",
};
inline constexpr Tunable<float> kWeightDecay{
    .name = "adam.weight_decay",
    .value = 0.0f,
    .json = "optimizer.params.weight_decay",
    .doc = "weight decay (decoupled or L2: adam.adam_w_mode)",
    .train = 0.01f,
};
inline constexpr Tunable<bool> kAdamWMode{
    .name = "adam.adam_w_mode",
    .value = true,  // FusedAdam and DeepSpeedCPUAdam: decoupled, even for type "Adam"
    .json = "optimizer.params.adam_w_mode, optimizer.type",
    .doc = "true: decoupled weight decay (AdamW); false: L2 added to the gradient",
};
inline constexpr Tunable<bool> kBiasCorrection{
    .name = "adam.bias_correction",
    .value = true,
    .json = "optimizer.params.bias_correction",
    .doc = "divide the moments by 1 - beta^t",
};

// ---- fp16 loss scaling
// ----------------------------------------------------------------------------

inline constexpr Tunable<float> kStaticLossScale{
    .name = "static_loss_scale",
    .value = 0.0f,
    .json = "fp16.loss_scale",
    .doc = "fp16: a fixed loss scale; 0 = dynamic",
};
inline constexpr Tunable<int> kInitialScalePower{
    .name = "initial_scale_power",
    .value = 16,
    .json = "fp16.initial_scale_power",
    .doc = "fp16, dynamic: the first scale is 2^power",
};
inline constexpr Tunable<int> kLossScaleWindow{
    .name = "loss_scale_window",
    .value = 1000,
    .unit = Unit::kSteps,
    .json = "fp16.loss_scale_window",
    .doc = "fp16, dynamic: steps without overflow before the scale doubles",
};
inline constexpr Tunable<int> kHysteresis{
    .name = "hysteresis",
    .value = 2,
    .unit = Unit::kCount,
    .json = "fp16.hysteresis",
    .doc = "fp16, dynamic: overflows tolerated before the scale halves",
};
inline constexpr Tunable<float> kMinLossScale{
    .name = "min_loss_scale",
    .value = 1.0f,
    .json = "fp16.min_loss_scale",
    .doc = "fp16, dynamic: the scale never drops below this",
};

// ---- non-finite gradients
// -------------------------------------------------------------------------

inline constexpr Tunable<uint64_t> kMaxNonfiniteSteps{
    .name = "max_nonfinite_steps",
    // Every precision skips a step whose global gradient norm is NaN or infinite. fp16's dynamic
    // loss scaling recovers from overflows by lowering the scale (a few halvings at the start are
    // normal), so only the skips at the minimum scale count there; in fp32 and bf16 (and with a
    // static fp16 scale) every skip counts. 8 in a row is no longer bad luck.
    .value = 8,
    .unit = Unit::kSteps,
    .json = "zinf.max_nonfinite_steps",
    .doc = "consecutive steps skipped for a non-finite gradient norm before step() fails; 0 = none",
};

// ---- ZeRO ---------------------------------------------------------------------------------------

inline constexpr Tunable<uint64_t> kReduceBucket{
    .name = "reduce_bucket_elements",
    .value = 500'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.reduce_bucket_size",
    .doc = "gradient elements reduced at once",
};
// DeepSpeed's default for an absent overlap_comm, which depends on the stage: on for stage 3. The
// config reader and `zinf train` apply it when nothing sets the key.
constexpr bool overlap_comm_for_stage(int stage) { return stage == 3; }

inline constexpr Tunable<bool> kOverlapComm{
    .name = "overlap_comm",
    .value = overlap_comm_for_stage(kStage.value),  // the default stage's
    .json = "zero_optimization.overlap_comm",
    .doc = "leave gradient reductions in flight across unit scopes (default: stage == 3)",
};
inline constexpr Tunable<uint64_t> kSubGroup{
    .name = "sub_group_elements",
    .value = 1'000'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.sub_group_size",
    .flag = "--sub-group",
    .doc = "optimizer sub-group size; capped to a third of host_mem when offloaded; 0 = per unit",
};
inline constexpr Tunable<uint64_t> kPrefetchBucket{
    .name = "prefetch_bucket_elements",
    .value = 50'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.stage3_prefetch_bucket_size",
    .flag = "--prefetch-bucket",
    .doc = "stage 3: parameter elements all-gathered ahead along the recorded order; 0 = off",
};
inline constexpr Tunable<uint64_t> kMaxLive{
    .name = "max_live_elements",
    .value = 1'000'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.stage3_max_live_parameters",
    .flag = "--max-live",
    .doc = "stage 3: parameter elements gathered at once (and at most what fits in device_mem)",
};
inline constexpr Tunable<uint64_t> kMaxReuseDistance{
    .name = "max_reuse_distance",
    .value = 1'000'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.stage3_max_reuse_distance",
    .flag = "--reuse-distance",
    .doc = "stage 3: keep a unit gathered when it is used again within this many; 0 = never",
};
inline constexpr Tunable<uint64_t> kParamPersistenceThreshold{
    .name = "param_persistence_threshold",
    .value = 100'000,  // DeepSpeed's 1e5
    .unit = Unit::kElements,
    .json = "zero_optimization.stage3_param_persistence_threshold",
    .doc = "stage 3: units of at most this many parameters stay gathered, all-gathered once/step",
};

// ---- offload ------------------------------------------------------------------------------------

inline constexpr Tunable<std::string_view> kParamHome{
    .name = "param_home",
    .value = "none",
    .json = "zero_optimization.offload_param.device",
    .flag = "--offload-param",
    .doc = "where the parameter shards live: none (the device), cpu, nvme (stage 3)",
};
inline constexpr Tunable<std::string_view> kOptimizerHome{
    .name = "optimizer_home",
    .value = "none",
    .json = "zero_optimization.offload_optimizer.device",
    .flag = "--offload-optimizer",
    .doc = "where the optimizer state lives and is updated: none (the device), cpu, nvme",
};
inline constexpr Tunable<double> kOptimizerOffloadRatio{
    .name = "optimizer_offload_ratio",
    .value = 1.0,
    .unit = Unit::kFraction,
    .json = "zero_optimization.offload_optimizer.ratio",
    .doc = "share of the optimizer state offloaded (whole units; below 1 needs stage 3)",
};
inline constexpr Tunable<std::string_view> kNvmePaths{
    .name = "nvme_paths",
    .value = "",  // none: NVMe offload needs the key or the flag
    .json =
        "zero_optimization.offload_param.nvme_path, zero_optimization.offload_optimizer.nvme_path",
    .flag = "--nvme-path",
    .doc =
        "swap directories, several striped (the flag repeats); zinf train removes the "
        "zinf-<pid>-* directories that dead zinf processes left there",
    .list = true,
};
inline constexpr Tunable<uint64_t> kParamMaxInCpu{
    .name = "param_max_in_cpu",
    .value = 1'000'000'000,
    .unit = Unit::kElements,
    .json = "zero_optimization.offload_param.max_in_cpu",
    .doc = "with NVMe offload and an automatic host budget: parameter elements of cache it holds",
};
inline constexpr Tunable<int64_t> kParamBufferCount{
    .name = "offload_param.buffer_count",
    .value = 5,
    .unit = Unit::kCount,
    .reader = Reader::kConfig,
    .json = "zero_optimization.offload_param.buffer_count",
    .doc = "staging_buffers when parameters are offloaded",
};
inline constexpr Tunable<uint32_t> kStagingBuffers{
    .name = "staging_buffers",
    .value = 4,  // offload_optimizer.buffer_count's default (Adam's 4 states per parameter)
    .unit = Unit::kCount,
    .json = "zero_optimization.offload_optimizer.buffer_count",
    .doc = "staging pieces in flight per NVMe <-> device move (offload_param's when it is on)",
};
inline constexpr Tunable<uint64_t> kStagingBytes{
    .name = "staging_bytes",
    .value = 2ull << 20,  // the engine's (DeepSpeed has no key)
    .unit = Unit::kBytes,
    .json = "zinf.staging_bytes",
    .doc = "NVMe <-> device staging piece; a multiple of 1 MiB",
};
inline constexpr Tunable<bool> kPinMemory{
    .name = "pin_memory",
    .value = false,  // DeepSpeed's
    .json =
        "zero_optimization.offload_param.pin_memory, "
        "zero_optimization.offload_optimizer.pin_memory",
    .doc = "page-locked host tier (on when either enabled offload block asks for it)",
};
inline constexpr Tunable<bool> kPipelineRead{
    .name = "pipeline_read",
    .value = false,  // DeepSpeed's
    .json = "zero_optimization.offload_optimizer.pipeline_read",
    .doc = "read the next optimizer sub-group while one is updated",
    .train = true,  // zinf train overlaps the optimizer's offload traffic with its updates
};
inline constexpr Tunable<bool> kPipelineWrite{
    .name = "pipeline_write",
    .value = false,  // DeepSpeed's
    .json = "zero_optimization.offload_optimizer.pipeline_write",
    .doc = "write an updated optimizer sub-group back while the next is updated",
    .train = true,  // zinf train overlaps the optimizer's offload traffic with its updates
};

// ---- I/O (DeepSpeed's "aio" block, on io_uring) ------------------------------------------------

inline constexpr Tunable<uint64_t> kIoBlockSize{
    .name = "io_block_size",
    .value = 1ull << 20,
    .unit = Unit::kBytes,
    .json = "aio.block_size",
    .doc = "largest piece one I/O request is split into; a multiple of 4096",
};
inline constexpr Tunable<uint32_t> kIoQueueDepth{
    .name = "io_queue_depth",
    .value = 8,  // DeepSpeed's
    .unit = Unit::kCount,
    .json = "aio.queue_depth",
    .doc = "I/O requests in flight per ring",
};
inline constexpr Tunable<uint32_t> kIoRings{
    .name = "io_rings",
    .value = 1,
    .unit = Unit::kCount,
    .json = "aio.intra_op_parallelism",
    .doc = "io_uring rings (one thread each) that share one large transfer",
};
inline constexpr Tunable<bool> kIoSingleSubmit{
    .name = "io_single_submit",
    .value = false,
    .json = "aio.single_submit",
    .doc = "submit every request with its own io_uring_enter instead of batching",
};

// ---- zinf's own ("zinf" JSON block and engine-only) --------------------------------------------

inline constexpr Tunable<uint64_t> kDeviceMem{
    .name = "device_mem",
    .value = 0,
    .unit = Unit::kBytes,
    .json = "zinf.device_mem",
    .flag = "--device-mem",
    .doc = "device byte budget per rank, e.g. 2G; left out (0): fit the machine (docs/engine.md)",
};
inline constexpr Tunable<uint64_t> kHostMem{
    .name = "host_mem",
    .value = 0,
    .unit = Unit::kBytes,
    .json = "zinf.host_mem",
    .flag = "--host-mem",
    .doc = "host byte budget per rank, e.g. 4G; left out (0): fit the machine (docs/engine.md)",
};
inline constexpr Tunable<bool> kOverlapOptimizer{
    .name = "overlap_optimizer",
    .value = false,
    .json = "zinf.overlap_optimizer",
    .flag = "--overlap-optimizer",
    .doc =
        "update each unit during the backward pass once its gradients are final; an inf/NaN "
        "gradient then stops the run (no skip)",
};
inline constexpr Tunable<bool> kUpdateBehind{
    .name = "update_behind",
    .value = true,
    .json = "zinf.update_behind",
    .doc =
        "one rank, stage 3, optimizer offloaded: step() returns once the norm is known and the "
        "update runs on under the next forward pass, each unit's use waiting for its update",
};
inline constexpr Tunable<bool> kChecksum{
    .name = "checksum",
    // On: a swap file changed behind zinf's back is an error naming the tensor and offset, not
    // training on corrupted state. Its cost: docs/security.md.
    .value = true,
    .json = "zinf.checksum",
    .flag = "--no-checksum",
    .doc = "an XXH3 checksum per swapped 1 MiB block, verified on read (--no-checksum: off)",
};
inline constexpr Tunable<uint64_t> kSeed{
    .name = "seed",
    .value = 0,
    .json = "zinf.seed",
    .flag = "--seed",
    .doc = "seed of the parameter initialisation (zinf train: also the data order)",
    .train = 1,
};
inline constexpr Tunable<std::string_view> kDevice{
    .name = "device",
    .value = "auto",
    .flag = "--device",
    .doc =
        "the top tier's device: auto ($ZINF_DEVICE, else cuda where a GPU is visible, else cpu), "
        "cpu, cpu-strict, cuda",
};
inline constexpr Tunable<int> kDeviceOrdinal{
    .name = "device_ordinal",
    .value = -1,
    .unit = Unit::kCount,
    .doc =
        "CUDA: the GPU of this rank; -1 = the launcher's LOCAL_RANK (zinf train --ranks: the "
        "rank) modulo the visible GPUs",
};
inline constexpr Tunable<int> kOptimizerThreads{
    .name = "optimizer_threads",
    .value = 0,
    .unit = Unit::kCount,
    .json = "zinf.optimizer_threads",
    .doc = "CPU Adam threads; 0 = all",
};
inline constexpr Tunable<bool> kIoFixedBuffers{
    .name = "io_fixed_buffers",
    .value = true,
    .json = "zinf.io_fixed_buffers",
    .doc = "register staging buffers with io_uring (fixed buffers)",
};
inline constexpr Tunable<std::string_view> kTrace{
    .name = "trace",
    .value = "",
    .reader = Reader::kTrain,
    .json = "zinf.trace",
    .flag = "--trace",
    .doc =
        "Chrome/Perfetto trace file to write; \"\" = none; under a launcher rank r writes its own, "
        "named with .rank<r> before the extension",
};

// ---- the catalogue ------------------------------------------------------------------------------

// A default of any entry's type: enums as their names (dtype "fp32"), integers widened.
using Value = std::variant<bool, int64_t, uint64_t, float, double, std::string_view>;

struct Entry {
  std::string_view name;
  Value value;
  Unit unit;
  Reader reader;
  std::string_view json;
  std::string_view flag;
  std::string_view doc;
  std::optional<Value> train;
  bool list;
};

namespace detail {
template <class T>
constexpr Value to_value(const T& v) {
  if constexpr (std::is_same_v<T, DType>) {
    return dtype_name(v);
  } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, float> ||
                       std::is_same_v<T, double> || std::is_same_v<T, std::string_view>) {
    return v;
  } else if constexpr (std::is_signed_v<T>) {
    return static_cast<int64_t>(v);
  } else {
    return static_cast<uint64_t>(v);
  }
}
template <class T>
constexpr Entry entry(const Tunable<T>& t) {
  std::optional<Value> train;
  if (t.train) train = to_value(*t.train);
  return {t.name, to_value(t.value), t.unit, t.reader, t.json, t.flag, t.doc, train, t.list};
}
}  // namespace detail

// Every entry above, in the order the start-up block prints them.
inline constexpr std::array kAll = {
    detail::entry(kStage),
    detail::entry(kDtype),
    detail::entry(kMicroBatch),
    detail::entry(kGradientAccumulationSteps),
    detail::entry(kGradientClipping),
    detail::entry(kOptimizerType),
    detail::entry(kLr),
    detail::entry(kLrSchedule),
    detail::entry(kWarmupSteps),
    detail::entry(kBeta1),
    detail::entry(kBeta2),
    detail::entry(kEps),
    detail::entry(kWeightDecay),
    detail::entry(kAdamWMode),
    detail::entry(kBiasCorrection),
    detail::entry(kStaticLossScale),
    detail::entry(kInitialScalePower),
    detail::entry(kLossScaleWindow),
    detail::entry(kHysteresis),
    detail::entry(kMinLossScale),
    detail::entry(kMaxNonfiniteSteps),
    detail::entry(kReduceBucket),
    detail::entry(kOverlapComm),
    detail::entry(kSubGroup),
    detail::entry(kPrefetchBucket),
    detail::entry(kMaxLive),
    detail::entry(kMaxReuseDistance),
    detail::entry(kParamPersistenceThreshold),
    detail::entry(kParamHome),
    detail::entry(kOptimizerHome),
    detail::entry(kOptimizerOffloadRatio),
    detail::entry(kNvmePaths),
    detail::entry(kParamMaxInCpu),
    detail::entry(kParamBufferCount),
    detail::entry(kStagingBuffers),
    detail::entry(kStagingBytes),
    detail::entry(kPinMemory),
    detail::entry(kPipelineRead),
    detail::entry(kPipelineWrite),
    detail::entry(kIoBlockSize),
    detail::entry(kIoQueueDepth),
    detail::entry(kIoRings),
    detail::entry(kIoSingleSubmit),
    detail::entry(kDeviceMem),
    detail::entry(kHostMem),
    detail::entry(kOverlapOptimizer),
    detail::entry(kUpdateBehind),
    detail::entry(kChecksum),
    detail::entry(kSeed),
    detail::entry(kDevice),
    detail::entry(kDeviceOrdinal),
    detail::entry(kOptimizerThreads),
    detail::entry(kIoFixedBuffers),
    detail::entry(kTrace),
};

// The entry named `name`, or nullptr.
constexpr const Entry* find(std::string_view name) {
  for (const Entry& e : kAll) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

// "1e-03", "true", "fp32", "2097152": a default as the start-up block prints it.
std::string to_string(const Value& v);

}  // namespace zinf::tunables
