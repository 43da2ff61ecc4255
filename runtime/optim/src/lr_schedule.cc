// Each formula follows DeepSpeed's lr_schedules.py term by term (the same operations in the same
// order, in double), so the values equal DeepSpeed's; the tests hold them against hand-computed
// values at chosen steps.
#include "zinf/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace zinf::optim {

using Type = config::SchedulerConfig::Type;
using WarmupType = config::SchedulerConfig::WarmupType;

Result<LrSchedule> LrSchedule::create(const config::SchedulerConfig& c, double optimizer_lr) {
  auto missing = [&](std::string_view key) {
    return make_error(ErrorCode::kInvalidArgument,
                      "scheduler.params.{}: {} requires a value; it was left out or \"auto\" and "
                      "nothing resolved it",
                      key, config::scheduler_type_name(c.type));
  };
  if ((c.type == Type::kWarmupDecayLR || c.type == Type::kWarmupCosineLR) && !c.total_num_steps) {
    return missing("total_num_steps");
  }
  if (c.type == Type::kOneCycle) {
    if (!c.cycle_min_lr) return missing("cycle_min_lr");
    if (!c.cycle_max_lr) return missing("cycle_max_lr");
  }
  if (!(std::isfinite(optimizer_lr) && optimizer_lr >= 0)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer.params.lr: expected a finite number >= 0, got {}", optimizer_lr);
  }
  config::Config check;
  check.scheduler = c;
  ZINF_RETURN_IF_ERROR(config::validate(check, 1));
  return LrSchedule(c, optimizer_lr);
}

LrSchedule::LrSchedule(const config::SchedulerConfig& c, double optimizer_lr)
    : c_(c), optimizer_lr_(optimizer_lr) {
  warmup_steps_ = std::max<int64_t>(2, c.warmup_num_steps);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_steps_));
  min_lr_ = c.warmup_min_lr;
  // WarmupLR's warmup_max_lr defaults to the optimizer's lr, WarmupDecayLR's to 0.001.
  max_lr_ =
      c.warmup_max_lr ? *c.warmup_max_lr : (c.type == Type::kWarmupDecayLR ? 0.001 : optimizer_lr);
  if (c.type == Type::kOneCycle) {
    const double first = c.cycle_first_step_size;
    second_step_size_ = c.cycle_second_step_size ? *c.cycle_second_step_size : first;
    total_size_ = first + second_step_size_;
    step_ratio_ = first / total_size_;
    second_stair_count_ =
        c.cycle_second_stair_count ? *c.cycle_second_stair_count : c.cycle_first_stair_count;
    skip_lr_decay_ = c.decay_step_size == 0 || c.decay_lr_rate == 0;
    skip_mom_decay_ = c.decay_step_size == 0 || c.decay_mom_rate == 0;
  }
}

double LrSchedule::warmup_gamma(int64_t i) const {
  const double it = static_cast<double>(i);
  if (i < warmup_steps_) {
    if (c_.warmup_type == WarmupType::kLog) return inverse_log_warmup_ * std::log(it + 1);
    return it / static_cast<double>(warmup_steps_);
  }
  if (c_.type == Type::kWarmupLR) return 1.0;
  // WarmupDecayLR: linear decay to 0 at total_num_steps.
  const double total = static_cast<double>(*c_.total_num_steps);
  return std::max(0.0, (total - it) / std::max(1.0, total - static_cast<double>(warmup_steps_)));
}

double LrSchedule::one_cycle_scale(int64_t i) const {
  const double batch_iteration = static_cast<double>(i + 1);
  const double cycle = std::floor(1 + batch_iteration / total_size_);
  const double x = 1. + batch_iteration / total_size_ - cycle;
  double scale = 0;
  int64_t stair_count = 0;
  if (x <= step_ratio_) {
    scale = x / step_ratio_;
    stair_count = c_.cycle_first_stair_count;
  } else {
    scale = (x - 1) / (step_ratio_ - 1);
    stair_count = second_stair_count_;
  }
  if (stair_count > 0) {
    // Quantised from the batch offset within the cycle, as DeepSpeed does.
    const double cycle_iteration = std::fmod(batch_iteration, total_size_);
    const double count = static_cast<double>(stair_count);
    const double position = cycle_iteration <= c_.cycle_first_step_size
                                ? cycle_iteration * count / c_.cycle_first_step_size
                                : (total_size_ - cycle_iteration) * count / second_step_size_;
    scale = std::floor(position) / count;
  }
  return scale;
}

double LrSchedule::lr_at(int64_t i) const {
  switch (c_.type) {
    case Type::kNone:
      return optimizer_lr_;
    case Type::kWarmupLR:
    case Type::kWarmupDecayLR:
      if (i < 0) return min_lr_;
      return min_lr_ + (max_lr_ - min_lr_) * warmup_gamma(i);
    case Type::kWarmupCosineLR: {
      if (i < 0) return 0.0;  // DeepSpeed's value before the first scheduler step
      double ratio = 0;
      if (i < warmup_steps_) {
        ratio = c_.warmup_type == WarmupType::kLog
                    ? inverse_log_warmup_ * std::log(static_cast<double>(i) + 1)
                    : static_cast<double>(i) / static_cast<double>(warmup_steps_);
        ratio = c_.warmup_min_ratio + ratio * (1. - c_.warmup_min_ratio);
      } else {
        const double real_last_step = static_cast<double>(i - warmup_steps_ + 1);
        const double real_total_steps =
            static_cast<double>(std::max<int64_t>(1, *c_.total_num_steps - warmup_steps_));
        const double progress = std::min(1.0, real_last_step / real_total_steps);
        ratio = (1 + std::cos(std::numbers::pi * progress)) / 2;
        ratio = std::max(0.0, c_.cos_min_ratio + (1. - c_.cos_min_ratio) * ratio);
      }
      return optimizer_lr_ * ratio;
    }
    case Type::kOneCycle: {
      const double min_lr = *c_.cycle_min_lr, max_lr = *c_.cycle_max_lr;
      if (static_cast<double>(i) < total_size_) {
        return min_lr + (max_lr - min_lr) * one_cycle_scale(i);
      }
      if (skip_lr_decay_) return min_lr;
      const double decay_iteration = static_cast<double>(i) - total_size_ + 1;
      return min_lr / (1 + c_.decay_lr_rate * (decay_iteration / c_.decay_step_size));
    }
  }
  return optimizer_lr_;
}

std::optional<Betas> LrSchedule::betas_at(int64_t i) const {
  if (c_.type != Type::kOneCycle || !c_.cycle_momentum) return std::nullopt;
  constexpr double kBeta2 = 0.99;  // DeepSpeed's, while momentum cycles
  const double min_mom = c_.cycle_min_mom, max_mom = c_.cycle_max_mom;
  if (i < 0) return Betas{min_mom, kBeta2};  // set at construction
  if (static_cast<double>(i) < total_size_) {
    return Betas{max_mom - (max_mom - min_mom) * one_cycle_scale(i), kBeta2};
  }
  if (skip_mom_decay_) return Betas{max_mom, kBeta2};
  const double decay_iteration = static_cast<double>(i) - total_size_ + 1;
  return Betas{max_mom * (1 + c_.decay_mom_rate * (decay_iteration / c_.decay_step_size)), kBeta2};
}

}  // namespace zinf::optim
