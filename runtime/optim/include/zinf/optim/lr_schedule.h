// DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py: WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle), computed from the "scheduler" block (config::SchedulerConfig).
//
// Contract, as DeepSpeed steps them. DeepSpeed builds the schedule with last_batch_iteration -1,
// which sets the optimizer's lr (and, for OneCycle with cycle_momentum, its betas) for the first
// step; after every APPLIED optimizer step (one not skipped for an fp16 overflow) it advances
// last_batch_iteration by one and sets the lr again. So the step that follows `applied` applied
// steps runs at lr_at(applied - 1):
//
//   auto schedule = optim::LrSchedule::create(cfg.scheduler, cfg.optimizer.lr).value();
//   for (...) {
//     engine.set_lr(schedule.lr_for_step(engine.last_step().step));   // before the step's work
//     ... forward, backward ...
//     engine.step();
//   }
//
// The values are computed in double, exactly as DeepSpeed's Python floats are, then handed to the
// optimizer (fp32). A pure function of the iteration: every rank computes the same value, and a
// resumed run needs only the number of applied steps.
#pragma once

#include <cstdint>
#include <optional>

#include "zinf/config/config.h"
#include "zinf/core/status.h"

namespace zinf::optim {

// Adam's (beta1, beta2) as OneCycle's momentum cycling sets them: (momentum, 0.99).
struct Betas {
  double beta1 = 0;
  double beta2 = 0;
};

class LrSchedule {
 public:
  // `optimizer_lr`: optimizer.params.lr, which WarmupLR uses as warmup_max_lr when that is absent
  // and WarmupCosineLR scales by its ratios; type kNone runs at it throughout. A required
  // parameter still missing (left "auto" and not resolved) is an error naming its key.
  static Result<LrSchedule> create(const config::SchedulerConfig& config, double optimizer_lr);

  // DeepSpeed's get_lr() at last_batch_iteration = `iteration` (>= -1; -1 is the value set at
  // construction, before any step).
  double lr_at(int64_t iteration) const;
  // OneCycle with cycle_momentum: DeepSpeed's betas at `iteration`; std::nullopt otherwise (the
  // optimizer keeps optimizer.params.betas).
  std::optional<Betas> betas_at(int64_t iteration) const;

  // The lr (betas) of the optimizer step that follows `applied_steps` applied steps.
  double lr_for_step(int64_t applied_steps) const { return lr_at(applied_steps - 1); }
  std::optional<Betas> betas_for_step(int64_t applied_steps) const {
    return betas_at(applied_steps - 1);
  }

  const config::SchedulerConfig& config() const { return c_; }

 private:
  LrSchedule(const config::SchedulerConfig& c, double optimizer_lr);
  double warmup_gamma(int64_t iteration) const;  // WarmupLR's and WarmupDecayLR's
  double one_cycle_scale(int64_t iteration) const;

  config::SchedulerConfig c_;
  double optimizer_lr_ = 0;
  // Derived as DeepSpeed's constructors derive them.
  double min_lr_ = 0, max_lr_ = 0;  // warm-up bounds (WarmupLR, WarmupDecayLR)
  int64_t warmup_steps_ = 2;        // max(2, warmup_num_steps)
  double inverse_log_warmup_ = 0;   // 1 / ln(warmup_steps_)
  double total_size_ = 0, step_ratio_ = 0, second_step_size_ = 0;  // OneCycle
  int64_t second_stair_count_ = 0;
  bool skip_lr_decay_ = true, skip_mom_decay_ = true;
};

}  // namespace zinf::optim
