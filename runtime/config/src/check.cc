#include "check.h"

#include <cmath>
#include <string>

#include "zinf/core/validate.h"

namespace zinf::config::detail {
namespace {

template <typename... Args>
Status invalid(fmt::format_string<Args...> f, Args&&... args) {
  return make_error(ErrorCode::kInvalidArgument, f, std::forward<Args>(args)...);
}

Status check_batch(const Config& c) {
  if (c.train_batch_size < 0) {
    return invalid("train_batch_size: expected a positive integer, got {}", c.train_batch_size);
  }
  if (c.train_micro_batch_size_per_gpu < 0) {
    return invalid("train_micro_batch_size_per_gpu: expected a positive integer, got {}",
                   c.train_micro_batch_size_per_gpu);
  }
  if (c.gradient_accumulation_steps < 0) {
    return invalid("gradient_accumulation_steps: expected a positive integer, got {}",
                   c.gradient_accumulation_steps);
  }
  // 0 means "derive from train_batch_size", which needs train_batch_size.
  if (c.train_batch_size == 0 &&
      (c.train_micro_batch_size_per_gpu == 0 || c.gradient_accumulation_steps == 0)) {
    return invalid(
        "{}: expected a positive integer (it can be left out only when train_batch_size is "
        "given), got 0",
        c.train_micro_batch_size_per_gpu == 0 ? "train_micro_batch_size_per_gpu"
                                              : "gradient_accumulation_steps");
  }
  return Status::ok();
}

Status check_optimizer(const OptimizerConfig& o) {
  // NaN fails every comparison; infinity is refused by name (an infinite step is no step).
  if (!(std::isfinite(o.lr) && o.lr >= 0)) {
    return invalid("optimizer.params.lr: expected a finite number >= 0, got {}", o.lr);
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
    return invalid("optimizer.params.betas: expected two numbers in [0, 1), got [{}, {}]", o.beta1,
                   o.beta2);
  }
  if (!(std::isfinite(o.eps) && o.eps > 0)) {
    return invalid("optimizer.params.eps: expected a finite number > 0, got {}", o.eps);
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0)) {
    return invalid("optimizer.params.weight_decay: expected a finite number >= 0, got {}",
                   o.weight_decay);
  }
  if (o.type == OptimizerConfig::Type::kAdamW && !o.adam_w_mode) {
    return invalid(
        "optimizer.params.adam_w_mode: AdamW always decays weights decoupled; expected true, or "
        "type Adam for L2 decay");
  }
  return Status::ok();
}

Status check_precision(const Config& c) {
  const Fp16Config& f = c.fp16;
  if (f.enabled && c.bf16) {
    return invalid(
        "fp16.enabled and bf16.enabled: only one 16-bit working precision can be enabled, both "
        "are true");
  }
  if (!(f.loss_scale >= 0)) {
    return invalid("fp16.loss_scale: expected a number >= 0 (0 = dynamic), got {}", f.loss_scale);
  }
  if (f.initial_scale_power < 0 || f.initial_scale_power > 127) {
    return invalid("fp16.initial_scale_power: expected an integer in 0..127, got {}",
                   f.initial_scale_power);
  }
  if (f.loss_scale_window < 1) {
    return invalid("fp16.loss_scale_window: expected an integer >= 1, got {}", f.loss_scale_window);
  }
  if (f.hysteresis < 1) {
    return invalid("fp16.hysteresis: expected an integer >= 1, got {}", f.hysteresis);
  }
  if (!(f.min_loss_scale > 0)) {
    return invalid("fp16.min_loss_scale: expected a number > 0, got {}", f.min_loss_scale);
  }
  return Status::ok();
}

// The rules of one offload block; `block` is "offload_param" or "offload_optimizer".
Status check_offload(const OffloadConfig& o, std::string_view block, int stage) {
  std::string path = fmt::format("zero_optimization.{}", block);
  bool is_param = block == "offload_param";
  const validate::Offloaded what =
      is_param ? validate::Offloaded::kParams : validate::Offloaded::kOptimizer;
  const std::string_view device = offload_device_name(o.device);
  ZINF_RETURN_IF_ERROR(validate::nvme_path_given(what, device, o.nvme_path.size()));
  for (size_t i = 0; i < o.nvme_path.size(); ++i) {
    if (o.nvme_path[i].empty()) {
      return invalid("{}.nvme_path[{}]: expected a non-empty directory path, got \"\"", path, i);
    }
  }
  if (o.buffer_count < 1) {
    return invalid("{}.buffer_count: expected an integer >= 1, got {}", path, o.buffer_count);
  }
  if (!is_param) ZINF_RETURN_IF_ERROR(validate::optimizer_offload_ratio(o.ratio));
  return validate::offload_stage(what, device, stage, o.ratio);
}

Status check_zero(const ZeroConfig& z) {
  ZINF_RETURN_IF_ERROR(validate::stage(z.stage));
  if (z.reduce_bucket_size == 0) {
    return invalid(
        "zero_optimization.reduce_bucket_size: expected a positive number of "
        "elements, got 0");
  }
  ZINF_RETURN_IF_ERROR(check_offload(z.offload_param, "offload_param", z.stage));
  ZINF_RETURN_IF_ERROR(check_offload(z.offload_optimizer, "offload_optimizer", z.stage));
  return Status::ok();
}

Status check_aio(const AioConfig& a) {
  constexpr uint64_t kBlockAlignment = 4096;
  if (a.block_size == 0 || a.block_size % kBlockAlignment != 0) {
    return invalid("aio.block_size: expected a positive multiple of 4096 bytes, got {}",
                   a.block_size);
  }
  if (a.queue_depth < 1) {
    return invalid("aio.queue_depth: expected an integer >= 1, got {}", a.queue_depth);
  }
  if (a.intra_op_parallelism < 1) {
    return invalid("aio.intra_op_parallelism: expected an integer >= 1, got {}",
                   a.intra_op_parallelism);
  }
  return Status::ok();
}

Status check_zinf(const ZinfConfig& z) {
  constexpr uint64_t kStagingAlignment = 1ull << 20;
  if (z.optimizer_threads < 0 || z.optimizer_threads > 4096) {
    return invalid("zinf.optimizer_threads: expected 0 (all cores) .. 4096, got {}",
                   z.optimizer_threads);
  }
  if (z.staging_bytes == 0 || z.staging_bytes % kStagingAlignment != 0) {
    return invalid("zinf.staging_bytes: expected a positive multiple of 1 MiB (1048576), got {}",
                   z.staging_bytes);
  }
  return Status::ok();
}

// Every parameter, whichever type uses it: those of other types are at their (valid) defaults.
Status check_scheduler(const SchedulerConfig& s) {
  auto finite_at_least = [](std::string_view key, double v, double lo) -> Status {
    if (std::isfinite(v) && v >= lo) return Status::ok();
    return invalid("scheduler.params.{}: expected a finite number >= {}, got {}", key, lo, v);
  };
  auto positive = [](std::string_view key, double v) -> Status {
    if (std::isfinite(v) && v > 0) return Status::ok();
    return invalid("scheduler.params.{}: expected a finite number > 0, got {}", key, v);
  };
  auto momentum = [](std::string_view key, double v) -> Status {
    if (v >= 0 && v < 1) return Status::ok();
    return invalid("scheduler.params.{}: expected a number in [0, 1) (Adam's beta1), got {}", key,
                   v);
  };
  ZINF_RETURN_IF_ERROR(finite_at_least("warmup_min_lr", s.warmup_min_lr, 0));
  if (s.warmup_max_lr) ZINF_RETURN_IF_ERROR(finite_at_least("warmup_max_lr", *s.warmup_max_lr, 0));
  if (s.warmup_num_steps < 1) {
    return invalid("scheduler.params.warmup_num_steps: expected a positive integer, got {}",
                   s.warmup_num_steps);
  }
  if (s.total_num_steps && *s.total_num_steps < 1) {
    return invalid("scheduler.params.total_num_steps: expected a positive integer, got {}",
                   *s.total_num_steps);
  }
  ZINF_RETURN_IF_ERROR(finite_at_least("warmup_min_ratio", s.warmup_min_ratio, 0));
  ZINF_RETURN_IF_ERROR(finite_at_least("cos_min_ratio", s.cos_min_ratio, 0));
  if (s.cycle_min_lr) ZINF_RETURN_IF_ERROR(finite_at_least("cycle_min_lr", *s.cycle_min_lr, 0));
  if (s.cycle_max_lr) ZINF_RETURN_IF_ERROR(finite_at_least("cycle_max_lr", *s.cycle_max_lr, 0));
  ZINF_RETURN_IF_ERROR(finite_at_least("decay_lr_rate", s.decay_lr_rate, 0));
  ZINF_RETURN_IF_ERROR(positive("cycle_first_step_size", s.cycle_first_step_size));
  if (s.cycle_second_step_size) {
    ZINF_RETURN_IF_ERROR(finite_at_least("cycle_second_step_size", *s.cycle_second_step_size, 0));
  }
  if (s.cycle_first_stair_count < 0) {
    return invalid("scheduler.params.cycle_first_stair_count: expected an integer >= 0, got {}",
                   s.cycle_first_stair_count);
  }
  if (s.cycle_second_stair_count && *s.cycle_second_stair_count < 0) {
    return invalid("scheduler.params.cycle_second_stair_count: expected an integer >= 0, got {}",
                   *s.cycle_second_stair_count);
  }
  ZINF_RETURN_IF_ERROR(finite_at_least("decay_step_size", s.decay_step_size, 0));
  ZINF_RETURN_IF_ERROR(momentum("cycle_min_mom", s.cycle_min_mom));
  ZINF_RETURN_IF_ERROR(momentum("cycle_max_mom", s.cycle_max_mom));
  if (!std::isfinite(s.decay_mom_rate)) {
    return invalid("scheduler.params.decay_mom_rate: expected a finite number, got {}",
                   s.decay_mom_rate);
  }
  return Status::ok();
}

}  // namespace

Status check_config(const Config& c) {
  ZINF_RETURN_IF_ERROR(check_batch(c));
  if (!(std::isfinite(c.gradient_clipping) && c.gradient_clipping >= 0)) {
    return invalid("gradient_clipping: expected a finite number >= 0 (0 = no clipping), got {}",
                   c.gradient_clipping);
  }
  ZINF_RETURN_IF_ERROR(check_optimizer(c.optimizer));
  ZINF_RETURN_IF_ERROR(check_precision(c));
  ZINF_RETURN_IF_ERROR(check_zero(c.zero));
  ZINF_RETURN_IF_ERROR(check_aio(c.aio));
  ZINF_RETURN_IF_ERROR(check_zinf(c.zinf));
  return check_scheduler(c.scheduler);
}

}  // namespace zinf::config::detail
