#include "zinf/engine/settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace zinf {
namespace {

namespace t = tunables;

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

// A field's value from the table's form (the effective configuration's JSON).
template <class T>
void from_json(const nlohmann::json& v, T& out) {
  if constexpr (std::is_same_v<T, float>) {
    out = static_cast<float>(v.get<double>());  // float_json's decimal reads back to the float
  } else if constexpr (std::is_same_v<T, Tier>) {
    out = EngineSettings::home_tier(v.get<std::string>());
  } else if constexpr (std::is_same_v<T, kernels::WeightDecayMode>) {
    out = v.get<bool>() ? kernels::WeightDecayMode::kDecoupled : kernels::WeightDecayMode::kL2;
  } else if constexpr (std::is_same_v<T, DType> || std::is_same_v<T, DeviceKind>) {
    throw std::logic_error("no single JSON key sets the precision or the device");
  } else {
    out = v.get<T>();
  }
}

template <auto Member>
constexpr EngineField field(std::string_view name) {
  return {name, [](const EngineSettings& s) { return value_json(s.*Member); },
          [](const nlohmann::json& v, EngineSettings& s) { from_json(v, s.*Member); }};
}
template <auto Member>
constexpr EngineField adam_field(std::string_view name) {
  return {name, [](const EngineSettings& s) { return value_json(s.adam.*Member); },
          [](const nlohmann::json& v, EngineSettings& s) { from_json(v, s.adam.*Member); }};
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
  // (By name, not through find()'s pointer: GCC's UBSan instrumentation makes a comparison of
  // addresses non-constant.)
  for (const EngineField& f : kFields) {
    bool found = false;
    for (const t::Entry& e : t::kAll) found |= e.name == f.name && e.reader == t::Reader::kEngine;
    if (!found) return false;
  }
  return true;
}
static_assert(fields_are_the_engine_entries(),
              "an engine entry of tunables.h without its line in kFields, or the other way round");

}  // namespace

Result<EngineSettings> settings_from_config(const config::Config& c) {
  EngineSettings s;
  // Every engine entry with one JSON key takes the value the configuration holds there (a key
  // to_json leaves out, a budget at 0 for "auto", keeps the default).
  const nlohmann::json effective = config::to_json(c);
  for (const EngineField& f : kFields) {
    const t::Entry& e = *t::find(f.name);
    if (e.json.empty() || e.json.find(',') != std::string_view::npos) continue;
    std::string pointer = "/" + std::string(e.json);
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    const nlohmann::json::json_pointer at(pointer);
    if (effective.contains(at) && effective.at(at).is_primitive()) f.set(effective.at(at), s);
  }
  // What one key does not say: the entries of several keys, two entries of one key (betas), and
  // the settings that depend on more than their key.
  s.dtype = c.working_dtype();
  s.gradient_accumulation_steps = static_cast<int>(c.gradient_accumulation_steps);  // 0: derive
  s.adam.beta1 = c.optimizer.beta1;
  s.adam.beta2 = c.optimizer.beta2;
  s.adam.weight_decay_mode = c.optimizer.adam_w_mode ? kernels::WeightDecayMode::kDecoupled
                                                     : kernels::WeightDecayMode::kL2;
  for (const auto* block : {&c.zero.offload_param, &c.zero.offload_optimizer}) {
    for (const std::string& p : block->nvme_path) {
      if (std::find(s.nvme_paths.begin(), s.nvme_paths.end(), p) == s.nvme_paths.end()) {
        s.nvme_paths.push_back(p);
      }
    }
  }
  s.io_queue_depth = static_cast<uint32_t>(std::max(c.aio.queue_depth, 1));
  s.io_rings = static_cast<uint32_t>(std::max(c.aio.intra_op_parallelism, 1));
  const config::OffloadConfig& param = c.zero.offload_param;
  const config::OffloadConfig& optim = c.zero.offload_optimizer;
  s.pin_memory = (param.enabled() && param.pin_memory) || (optim.enabled() && optim.pin_memory);
  // Staging pieces in flight per move: the parameter block's buffers when parameters are
  // offloaded (they are what moves to the device), else the optimizer block's.
  s.staging_buffers = static_cast<uint32_t>(
      std::max<int64_t>(param.enabled() ? param.buffer_count : optim.buffer_count, 2));
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
