#include "zinf/engine/settings.h"

#include <algorithm>

namespace zinf {
namespace {

Tier tier_of(config::OffloadDevice d) {
  switch (d) {
    case config::OffloadDevice::kNone:
      return Tier::kDevice;
    case config::OffloadDevice::kCpu:
      return Tier::kHost;
    case config::OffloadDevice::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
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
  return s;
}

}  // namespace zinf
