#include "zinf/engine/settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace zinf {
namespace {

namespace t = tunables;

Tier tier_of(config::OffloadDevice d) {
  return EngineSettings::home_tier(config::offload_device_name(d));
}

// The shortest decimal that reads back to the same float ("0.003", not 0.003000000026077032).
nlohmann::json float_json(float f) {
  std::string shortest = fmt::format("{}", f);
  double d = std::strtod(shortest.c_str(), nullptr);
  if (static_cast<float>(d) != f) d = static_cast<double>(f);
  return d;
}

// A field's value in the table's form.
template <class T>
nlohmann::json value_json(const T& v) {
  if constexpr (std::is_same_v<T, float>) {
    return float_json(v);
  } else if constexpr (std::is_same_v<T, DType>) {
    return dtype_name(v);
  } else if constexpr (std::is_same_v<T, Tier>) {
    return EngineSettings::home_name(v);
  } else if constexpr (std::is_same_v<T, DeviceKind>) {
    return device_kind_name(v);
  } else if constexpr (std::is_same_v<T, kernels::WeightDecayMode>) {
    return v == kernels::WeightDecayMode::kDecoupled;  // adam.adam_w_mode
  } else {
    return v;  // integers, bools, double, the list of paths
  }
}

template <auto Member>
constexpr EngineField field(std::string_view name) {
  return {name, [](const EngineSettings& s) { return value_json(s.*Member); }};
}
template <auto Member>
constexpr EngineField adam_field(std::string_view name) {
  return {name, [](const EngineSettings& s) { return value_json(s.adam.*Member); }};
}

using S = EngineSettings;
using Adam = kernels::AdamConfig;

// Every EngineSettings field, by the entry that declares it.
constexpr EngineField kFields[] = {
    field<&S::stage>(t::kStage.name),
    field<&S::dtype>(t::kDtype.name),
    field<&S::gradient_accumulation_steps>(t::kGradientAccumulationSteps.name),
    field<&S::gradient_clipping>(t::kGradientClipping.name),
    adam_field<&Adam::lr>(t::kLr.name),
    adam_field<&Adam::beta1>(t::kBeta1.name),
    adam_field<&Adam::beta2>(t::kBeta2.name),
    adam_field<&Adam::eps>(t::kEps.name),
    adam_field<&Adam::weight_decay>(t::kWeightDecay.name),
    adam_field<&Adam::weight_decay_mode>(t::kAdamWMode.name),
    adam_field<&Adam::bias_correction>(t::kBiasCorrection.name),
    field<&S::static_loss_scale>(t::kStaticLossScale.name),
    field<&S::initial_scale_power>(t::kInitialScalePower.name),
    field<&S::loss_scale_window>(t::kLossScaleWindow.name),
    field<&S::hysteresis>(t::kHysteresis.name),
    field<&S::min_loss_scale>(t::kMinLossScale.name),
    field<&S::max_nonfinite_steps>(t::kMaxNonfiniteSteps.name),
    field<&S::reduce_bucket_elements>(t::kReduceBucket.name),
    field<&S::overlap_comm>(t::kOverlapComm.name),
    field<&S::sub_group_elements>(t::kSubGroup.name),
    field<&S::prefetch_bucket_elements>(t::kPrefetchBucket.name),
    field<&S::max_live_elements>(t::kMaxLive.name),
    field<&S::max_reuse_distance>(t::kMaxReuseDistance.name),
    field<&S::param_persistence_threshold>(t::kParamPersistenceThreshold.name),
    field<&S::param_home>(t::kParamHome.name),
    field<&S::optimizer_home>(t::kOptimizerHome.name),
    field<&S::optimizer_offload_ratio>(t::kOptimizerOffloadRatio.name),
    field<&S::nvme_paths>(t::kNvmePaths.name),
    field<&S::param_max_in_cpu>(t::kParamMaxInCpu.name),
    field<&S::staging_buffers>(t::kStagingBuffers.name),
    field<&S::staging_bytes>(t::kStagingBytes.name),
    field<&S::pin_memory>(t::kPinMemory.name),
    field<&S::pipeline_read>(t::kPipelineRead.name),
    field<&S::pipeline_write>(t::kPipelineWrite.name),
    field<&S::io_block_size>(t::kIoBlockSize.name),
    field<&S::io_queue_depth>(t::kIoQueueDepth.name),
    field<&S::io_rings>(t::kIoRings.name),
    field<&S::io_single_submit>(t::kIoSingleSubmit.name),
    field<&S::device_mem>(t::kDeviceMem.name),
    field<&S::host_mem>(t::kHostMem.name),
    field<&S::overlap_optimizer>(t::kOverlapOptimizer.name),
    field<&S::update_behind>(t::kUpdateBehind.name),
    field<&S::checksum>(t::kChecksum.name),
    field<&S::seed>(t::kSeed.name),
    field<&S::device>(t::kDevice.name),
    field<&S::device_ordinal>(t::kDeviceOrdinal.name),
    field<&S::optimizer_threads>(t::kOptimizerThreads.name),
    field<&S::io_fixed_buffers>(t::kIoFixedBuffers.name),
};

// Each field's entry is in the table, read by the engine, and the table has no other engine entry.
constexpr bool fields_are_the_engine_entries() {
  size_t engine_entries = 0;
  for (const t::Entry& e : t::kAll) engine_entries += e.reader == t::Reader::kEngine;
  if (engine_entries != std::size(kFields)) return false;
  for (const EngineField& f : kFields) {
    const t::Entry* e = t::find(f.name);
    if (e == nullptr || e->reader != t::Reader::kEngine) return false;
  }
  return true;
}
static_assert(fields_are_the_engine_entries(),
              "an engine entry of tunables.h without its line in kFields, or the other way round");

}  // namespace

Result<EngineSettings> settings_from_config(const config::Config& c) {
  EngineSettings s;
  s.stage = c.zero.stage;
  s.dtype = c.working_dtype();
  s.gradient_accumulation_steps = static_cast<int>(c.gradient_accumulation_steps);
  s.gradient_clipping = c.gradient_clipping;
  s.adam.lr = c.optimizer.lr;
  s.adam.beta1 = c.optimizer.beta1;
  s.adam.beta2 = c.optimizer.beta2;
  s.adam.eps = c.optimizer.eps;
  s.adam.weight_decay = c.optimizer.weight_decay;
  s.adam.weight_decay_mode = c.optimizer.adam_w_mode ? kernels::WeightDecayMode::kDecoupled
                                                     : kernels::WeightDecayMode::kL2;
  s.adam.bias_correction = c.optimizer.bias_correction;
  s.static_loss_scale = c.fp16.loss_scale;
  s.initial_scale_power = c.fp16.initial_scale_power;
  s.loss_scale_window = c.fp16.loss_scale_window;
  s.hysteresis = c.fp16.hysteresis;
  s.min_loss_scale = c.fp16.min_loss_scale;
  s.reduce_bucket_elements = c.zero.reduce_bucket_size;
  s.overlap_comm = c.zero.overlap_comm;
  s.param_home = tier_of(c.zero.offload_param.device);
  s.optimizer_home = tier_of(c.zero.offload_optimizer.device);
  for (const auto* block : {&c.zero.offload_param, &c.zero.offload_optimizer}) {
    for (const std::string& p : block->nvme_path) {
      if (std::find(s.nvme_paths.begin(), s.nvme_paths.end(), p) == s.nvme_paths.end()) {
        s.nvme_paths.push_back(p);
      }
    }
  }
  s.device_mem = c.zinf.device_mem;
  s.host_mem = c.zinf.host_mem;
  s.staging_bytes = c.zinf.staging_bytes;
  s.seed = c.zinf.seed;
  s.checksum = c.zinf.checksum;
  s.io_queue_depth = static_cast<uint32_t>(std::max(c.aio.queue_depth, 1));
  s.io_block_size = c.aio.block_size;
  s.io_rings = static_cast<uint32_t>(std::max(c.aio.intra_op_parallelism, 1));
  s.io_single_submit = c.aio.single_submit;
  const config::OffloadConfig& param = c.zero.offload_param;
  const config::OffloadConfig& optim = c.zero.offload_optimizer;
  s.param_max_in_cpu = param.max_in_cpu;
  s.pin_memory = (param.enabled() && param.pin_memory) || (optim.enabled() && optim.pin_memory);
  // Staging pieces in flight per move: the parameter block's buffers when parameters are
  // offloaded (they are what moves to the device), else the optimizer block's.
  s.staging_buffers = static_cast<uint32_t>(
      std::max<int64_t>(param.enabled() ? param.buffer_count : optim.buffer_count, 2));
  s.pipeline_read = optim.pipeline_read;
  s.pipeline_write = optim.pipeline_write;
  s.optimizer_offload_ratio = c.zero.offload_optimizer.ratio;
  s.param_persistence_threshold = c.zero.stage3_param_persistence_threshold;
  s.prefetch_bucket_elements = c.zero.stage3_prefetch_bucket_size;
  s.max_live_elements = c.zero.stage3_max_live_parameters;
  s.max_reuse_distance = c.zero.stage3_max_reuse_distance;
  s.sub_group_elements = c.zero.sub_group_size;
  s.overlap_optimizer = c.zinf.overlap_optimizer;
  s.update_behind = c.zinf.update_behind;
  s.optimizer_threads = c.zinf.optimizer_threads;
  s.io_fixed_buffers = c.zinf.io_fixed_buffers;
  s.max_nonfinite_steps = c.zinf.max_nonfinite_steps;
  return s;
}

std::span<const EngineField> engine_fields() { return kFields; }

nlohmann::json settings_json(const EngineSettings& s) {
  nlohmann::json j = nlohmann::json::object();
  for (const EngineField& f : kFields) j[std::string(f.name)] = f.get(s);
  return j;
}

nlohmann::json tunable_json(const tunables::Entry& e, const tunables::Value& v) {
  return std::visit(
      [&](const auto& x) -> nlohmann::json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, float>) {
          return float_json(x);
        } else if constexpr (std::is_same_v<T, std::string_view>) {
          if (e.list) return nlohmann::json::array();
          return std::string(x);
        } else {
          return x;
        }
      },
      v);
}

}  // namespace zinf
