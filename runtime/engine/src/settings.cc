#include "zinf/engine/settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace zinf {
namespace {

Tier tier_of(config::OffloadDevice d) {
  return EngineSettings::home_tier(config::offload_device_name(d));
}

std::string_view offload_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "none";
    case Tier::kHost:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "none";
}

// The shortest decimal that reads back to the same float ("0.003", not 0.003000000026077032).
nlohmann::json float_json(float f) {
  std::string shortest = fmt::format("{}", f);
  double d = std::strtod(shortest.c_str(), nullptr);
  if (static_cast<float>(d) != f) d = static_cast<double>(f);
  return d;
}

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

nlohmann::json settings_json(const EngineSettings& s) {
  using nlohmann::json;
  json j = json::object();
  j["stage"] = s.stage;
  j["dtype"] = dtype_name(s.dtype);
  j["gradient_accumulation_steps"] = s.gradient_accumulation_steps;
  j["gradient_clipping"] = float_json(s.gradient_clipping);
  j["adam.lr"] = float_json(s.adam.lr);
  j["adam.beta1"] = float_json(s.adam.beta1);
  j["adam.beta2"] = float_json(s.adam.beta2);
  j["adam.eps"] = float_json(s.adam.eps);
  j["adam.weight_decay"] = float_json(s.adam.weight_decay);
  j["adam.adam_w_mode"] = s.adam.weight_decay_mode == kernels::WeightDecayMode::kDecoupled;
  j["adam.bias_correction"] = s.adam.bias_correction;
  j["static_loss_scale"] = float_json(s.static_loss_scale);
  j["initial_scale_power"] = s.initial_scale_power;
  j["loss_scale_window"] = s.loss_scale_window;
  j["hysteresis"] = s.hysteresis;
  j["min_loss_scale"] = float_json(s.min_loss_scale);
  j["reduce_bucket_elements"] = s.reduce_bucket_elements;
  j["overlap_comm"] = s.overlap_comm;
  j["sub_group_elements"] = s.sub_group_elements;
  j["prefetch_bucket_elements"] = s.prefetch_bucket_elements;
  j["max_live_elements"] = s.max_live_elements;
  j["max_reuse_distance"] = s.max_reuse_distance;
  j["param_persistence_threshold"] = s.param_persistence_threshold;
  j["param_home"] = offload_name(s.param_home);
  j["optimizer_home"] = offload_name(s.optimizer_home);
  j["optimizer_offload_ratio"] = s.optimizer_offload_ratio;
  j["nvme_paths"] = s.nvme_paths;
  j["param_max_in_cpu"] = s.param_max_in_cpu;
  j["staging_buffers"] = s.staging_buffers;
  j["staging_bytes"] = s.staging_bytes;
  j["pin_memory"] = s.pin_memory;
  j["pipeline_read"] = s.pipeline_read;
  j["pipeline_write"] = s.pipeline_write;
  j["io_block_size"] = s.io_block_size;
  j["io_queue_depth"] = s.io_queue_depth;
  j["io_rings"] = s.io_rings;
  j["io_single_submit"] = s.io_single_submit;
  j["io_fixed_buffers"] = s.io_fixed_buffers;
  j["device_mem"] = s.device_mem;
  j["host_mem"] = s.host_mem;
  j["overlap_optimizer"] = s.overlap_optimizer;
  j["update_behind"] = s.update_behind;
  j["checksum"] = s.checksum;
  j["max_nonfinite_steps"] = s.max_nonfinite_steps;
  j["seed"] = s.seed;
  j["device"] = device_kind_name(s.device);
  j["device_ordinal"] = s.device_ordinal;
  j["optimizer_threads"] = s.optimizer_threads;
  return j;
}

nlohmann::json tunable_json(const tunables::Entry& e, const tunables::Value& v) {
  return std::visit(
      [&](const auto& x) -> nlohmann::json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, float>) {
          return float_json(x);
        } else if constexpr (std::is_same_v<T, std::string_view>) {
          if (e.name == tunables::kNvmePaths.name) return nlohmann::json::array();
          return std::string(x);
        } else {
          return x;
        }
      },
      v);
}

}  // namespace zinf
