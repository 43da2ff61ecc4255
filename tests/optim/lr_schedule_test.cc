// DeepSpeed's learning-rate schedules, step by step. The tables below are what DeepSpeed itself
// gives: deepspeed/runtime/lr_schedules.py (deepspeedai/DeepSpeed at edaa722) run under Python with
// a one-group stand-in optimizer, recording the group's lr (and betas) before each of the first n
// optimizer steps, the scheduler stepped after each (as DeepSpeed's engine does after every
// applied step). Each table's comment gives the parameters it was made with. A few values are
// also derived by hand below, so that a table and the formula it was made from agree on paper.
#include "zinf/optim/lr_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>

namespace zinf::optim {
namespace {

using config::SchedulerConfig;
using Type = SchedulerConfig::Type;
using WarmupType = SchedulerConfig::WarmupType;
using ::testing::HasSubstr;

// clang-format off
// WarmupLog {'warmup_min_lr': 0.0001, 'warmup_max_lr': 0.01, 'warmup_num_steps': 10} optimizer lr 0.001
constexpr double kWarmupLogLr[] = {0.0001, 0.0001, 0.0030801969570734135, 0.004823500421724658, 0.0060603939141468275, 0.007019803042926586, 0.007803697378798072, 0.008466470596141142, 0.00904059087122024, 0.009547000843449316, 0.009999999999999998, 0.01, 0.01, 0.01};
// WarmupLinearDefaultMax {'warmup_num_steps': 8, 'warmup_type': 'linear'} optimizer lr 0.003
constexpr double kWarmupLinearDefaultMaxLr[] = {0.0, 0.0, 0.000375, 0.00075, 0.0011250000000000001, 0.0015, 0.001875, 0.0022500000000000003, 0.002625, 0.003, 0.003, 0.003};
// WarmupOneStep {'warmup_min_lr': 0.0, 'warmup_max_lr': 0.5, 'warmup_num_steps': 1, 'warmup_type': 'linear'} optimizer lr 0.001
constexpr double kWarmupOneStepLr[] = {0.0, 0.0, 0.25, 0.5, 0.5};
// WarmupDecayLinear {'total_num_steps': 20, 'warmup_min_lr': 0.001, 'warmup_max_lr': 0.01, 'warmup_num_steps': 5, 'warmup_type': 'linear'} optimizer lr 0.001
constexpr double kWarmupDecayLinearLr[] = {0.001, 0.001, 0.0028000000000000004, 0.004600000000000001, 0.0064, 0.008200000000000002, 0.010000000000000002, 0.009400000000000002, 0.008800000000000002, 0.008200000000000002, 0.0076, 0.007, 0.0064, 0.0058000000000000005, 0.005200000000000001, 0.004600000000000001, 0.004, 0.0034000000000000002, 0.0028000000000000004, 0.0022, 0.0016, 0.001, 0.001, 0.001};
// WarmupDecayLogDefaults {'total_num_steps': 12, 'warmup_num_steps': 4} optimizer lr 0.5
constexpr double kWarmupDecayLogDefaultsLr[] = {0.0, 0.0, 0.0005, 0.0007924812503605781, 0.001, 0.001, 0.000875, 0.00075, 0.000625, 0.0005, 0.000375, 0.00025, 0.000125, 0.0, 0.0};
// WarmupCosineLog {'total_num_steps': 16, 'warmup_min_ratio': 0.1, 'warmup_num_steps': 4, 'cos_min_ratio': 0.05} optimizer lr 0.02
constexpr double kWarmupCosineLogLr[] = {0.0, 0.002, 0.011000000000000001, 0.016264662506490408, 0.02, 0.01967629534974615, 0.01872724133595217, 0.0172175144212722, 0.01525, 0.012958780928473948, 0.0105, 0.008041219071526051, 0.005750000000000002, 0.003782485578727799, 0.0022727586640478325, 0.0013237046502538523, 0.001, 0.001, 0.001, 0.001};
// WarmupCosineLinear {'total_num_steps': 10, 'warmup_num_steps': 3, 'warmup_type': 'linear'} optimizer lr 0.1
constexpr double kWarmupCosineLinearLr[] = {0.0, 0.0, 0.03333333333333333, 0.06666666666666667, 0.09504893855078145, 0.0811763726439274, 0.06112993409314593, 0.03888006590685407, 0.01883362735607262, 0.004961061449218561, 1e-05, 1e-05, 1e-05};
// OneCycleMomentum {'cycle_min_lr': 0.001, 'cycle_max_lr': 0.01, 'cycle_first_step_size': 4, 'cycle_second_step_size': 6, 'decay_lr_rate': 0.5, 'decay_step_size': 2, 'decay_mom_rate': 0.01} optimizer lr 0.001
constexpr double kOneCycleMomentumLr[] = {0.001, 0.0032500000000000025, 0.0055, 0.007750000000000002, 0.009999999999999998, 0.0085, 0.006999999999999999, 0.005500000000000001, 0.004, 0.0025000000000000014, 0.001, 0.0008, 0.0006666666666666666, 0.0005714285714285715, 0.0005, 0.00044444444444444447};
constexpr double kOneCycleMomentumBeta1[] = {0.8, 0.875, 0.8500000000000001, 0.8250000000000001, 0.8, 0.8166666666666667, 0.8333333333333334, 0.85, 0.8666666666666667, 0.8833333333333333, 0.9, 0.9045, 0.909, 0.9135, 0.918, 0.9225};
constexpr double kOneCycleMomentumBeta2[] = {0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99};
// OneCycleStairs {'cycle_min_lr': 0.0, 'cycle_max_lr': 0.1, 'cycle_first_step_size': 6, 'cycle_first_stair_count': 3, 'cycle_second_stair_count': 2, 'cycle_momentum': False} optimizer lr 0.001
constexpr double kOneCycleStairsLr[] = {0.0, 0.0, 0.03333333333333333, 0.03333333333333333, 0.06666666666666667, 0.06666666666666667, 0.1, 0.05, 0.05, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
// OneCycleNoDecay {'cycle_min_lr': 0.002, 'cycle_max_lr': 0.004, 'cycle_first_step_size': 3, 'decay_lr_rate': 0.1, 'cycle_momentum': False} optimizer lr 0.001
constexpr double kOneCycleNoDecayLr[] = {0.002, 0.002666666666666667, 0.003333333333333333, 0.004, 0.003333333333333334, 0.002666666666666666, 0.002, 0.002, 0.002};
// clang-format on

LrSchedule make(const SchedulerConfig& c, double optimizer_lr) {
  Result<LrSchedule> s = LrSchedule::create(c, optimizer_lr);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return std::move(s).value();
}

// lr_for_step(k) for every k against DeepSpeed's lr of step k + 1 (libm's log and cos, as
// Python's math module calls them: equal to within a few ulps, in practice exactly).
void expect_lrs(const LrSchedule& s, std::span<const double> want) {
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_DOUBLE_EQ(s.lr_for_step(static_cast<int64_t>(k)), want[k]) << "optimizer step " << k + 1;
  }
}

TEST(LrSchedule, WarmupLrLog) {
  const LrSchedule s = make({.type = Type::kWarmupLR,
                             .warmup_min_lr = 0.0001,
                             .warmup_max_lr = 0.01,
                             .warmup_num_steps = 10},
                            0.001);
  expect_lrs(s, kWarmupLogLr);
  // By hand: step 3 runs at iteration 1: min + (max - min) * ln(2) / ln(10).
  EXPECT_DOUBLE_EQ(s.lr_for_step(2), 0.0001 + 0.0099 * std::log(2.0) / std::log(10.0));
  // Steps 1 and 2 both run at min_lr (construction, then iteration 0: ln 1 = 0).
  EXPECT_EQ(s.lr_for_step(0), 0.0001);
  EXPECT_EQ(s.lr_for_step(1), 0.0001);
  EXPECT_EQ(s.lr_for_step(1000), 0.01);
  EXPECT_FALSE(s.betas_for_step(3).has_value());
}

TEST(LrSchedule, WarmupLrLinearDefaultsToTheOptimizerLr) {
  // warmup_min_lr 0 and warmup_max_lr absent: DeepSpeed takes the optimizer's lr.
  const LrSchedule s = make(
      {.type = Type::kWarmupLR, .warmup_num_steps = 8, .warmup_type = WarmupType::kLinear}, 0.003);
  expect_lrs(s, kWarmupLinearDefaultMaxLr);
  EXPECT_DOUBLE_EQ(s.lr_for_step(4), 0.003 * 3 / 8);  // iteration 3 of 8, by hand
}

TEST(LrSchedule, WarmupOfOneStepIsTwo) {
  // DeepSpeed warms up over max(2, warmup_num_steps) steps.
  expect_lrs(make({.type = Type::kWarmupLR,
                   .warmup_max_lr = 0.5,
                   .warmup_num_steps = 1,
                   .warmup_type = WarmupType::kLinear},
                  0.001),
             kWarmupOneStepLr);
}

TEST(LrSchedule, WarmupDecayLrLinear) {
  const LrSchedule s = make({.type = Type::kWarmupDecayLR,
                             .warmup_min_lr = 0.001,
                             .warmup_max_lr = 0.01,
                             .warmup_num_steps = 5,
                             .warmup_type = WarmupType::kLinear,
                             .total_num_steps = 20},
                            0.001);
  expect_lrs(s, kWarmupDecayLinearLr);
  // By hand: iteration 10 (step 12) decays by (20 - 10) / (20 - 5).
  EXPECT_DOUBLE_EQ(s.lr_for_step(11), 0.001 + 0.009 * (10.0 / 15.0));
  EXPECT_EQ(s.lr_for_step(100), 0.001) << "after total_num_steps: warmup_min_lr";
}

TEST(LrSchedule, WarmupDecayLrLogWithDeepSpeedsDefaultMax) {
  // warmup_max_lr absent: WarmupDecayLR's own default 0.001, not the optimizer's 0.5.
  const LrSchedule s =
      make({.type = Type::kWarmupDecayLR, .warmup_num_steps = 4, .total_num_steps = 12}, 0.5);
  expect_lrs(s, kWarmupDecayLogDefaultsLr);
  EXPECT_DOUBLE_EQ(s.lr_for_step(3), 0.001 * std::log(3.0) / std::log(4.0));
}

TEST(LrSchedule, WarmupCosineLrLog) {
  const LrSchedule s = make({.type = Type::kWarmupCosineLR,
                             .warmup_num_steps = 4,
                             .total_num_steps = 16,
                             .warmup_min_ratio = 0.1,
                             .cos_min_ratio = 0.05},
                            0.02);
  expect_lrs(s, kWarmupCosineLogLr);
  EXPECT_EQ(s.lr_for_step(0), 0.0) << "DeepSpeed's value before its first scheduler step";
  // By hand: iteration 8 (step 10) is 5 of 12 decay steps: ratio 0.05 + 0.95 (1 + cos(5pi/12))/2.
  EXPECT_DOUBLE_EQ(s.lr_for_step(9),
                   0.02 * (0.05 + 0.95 * (1 + std::cos(std::acos(-1.0) * 5 / 12)) / 2));
  EXPECT_DOUBLE_EQ(s.lr_for_step(500), 0.02 * 0.05) << "held at cos_min_ratio";
}

TEST(LrSchedule, WarmupCosineLrLinearDefaults) {
  const LrSchedule s = make({.type = Type::kWarmupCosineLR,
                             .warmup_num_steps = 3,
                             .warmup_type = WarmupType::kLinear,
                             .total_num_steps = 10},
                            0.1);
  expect_lrs(s, kWarmupCosineLinearLr);
  EXPECT_DOUBLE_EQ(s.lr_for_step(10), 0.1 * 0.0001) << "cos_min_ratio's default";
}

TEST(LrSchedule, OneCycleWithMomentumAndDecay) {
  const LrSchedule s = make({.type = Type::kOneCycle,
                             .cycle_min_lr = 0.001,
                             .cycle_max_lr = 0.01,
                             .decay_lr_rate = 0.5,
                             .cycle_first_step_size = 4,
                             .cycle_second_step_size = 6,
                             .decay_step_size = 2,
                             .decay_mom_rate = 0.01},
                            0.001);
  expect_lrs(s, kOneCycleMomentumLr);
  for (size_t k = 0; k < std::size(kOneCycleMomentumBeta1); ++k) {
    std::optional<Betas> b = s.betas_for_step(static_cast<int64_t>(k));
    ASSERT_TRUE(b.has_value());
    EXPECT_DOUBLE_EQ(b->beta1, kOneCycleMomentumBeta1[k]) << "step " << k + 1;
    EXPECT_EQ(b->beta2, kOneCycleMomentumBeta2[k]) << "step " << k + 1;
  }
  // By hand: the peak at iteration 3 (x = 0.4 = step_ratio), then the second half descends over 6
  // steps; after the cycle lr = min / (1 + 0.5 * d / 2) for decay iteration d.
  EXPECT_DOUBLE_EQ(s.lr_for_step(4), 0.01);
  EXPECT_DOUBLE_EQ(s.lr_for_step(12), 0.001 / (1 + 0.5 * (2.0 / 2)));
  EXPECT_DOUBLE_EQ(s.betas_for_step(12)->beta1, 0.9 * (1 + 0.01 * (2.0 / 2)));
}

TEST(LrSchedule, OneCycleStaircase) {
  const LrSchedule s = make({.type = Type::kOneCycle,
                             .cycle_min_lr = 0.0,
                             .cycle_max_lr = 0.1,
                             .cycle_first_step_size = 6,
                             .cycle_first_stair_count = 3,
                             .cycle_second_stair_count = 2,
                             .cycle_momentum = false},
                            0.001);
  expect_lrs(s, kOneCycleStairsLr);
  EXPECT_FALSE(s.betas_for_step(2).has_value()) << "cycle_momentum false: betas left alone";
}

TEST(LrSchedule, OneCycleWithoutDecayStepSizeStaysAtTheMinimum) {
  // decay_lr_rate without decay_step_size: DeepSpeed skips the decay.
  expect_lrs(make({.type = Type::kOneCycle,
                   .cycle_min_lr = 0.002,
                   .cycle_max_lr = 0.004,
                   .decay_lr_rate = 0.1,
                   .cycle_first_step_size = 3,
                   .cycle_momentum = false},
                  0.001),
             kOneCycleNoDecayLr);
}

TEST(LrSchedule, NoScheduleIsTheOptimizerLr) {
  const LrSchedule s = make({}, 0.25);
  EXPECT_EQ(s.lr_for_step(0), 0.25);
  EXPECT_EQ(s.lr_for_step(12345), 0.25);
}

// The tables are not vacuous: another warm-up type or a missed scheduler step shows.
TEST(LrSchedule, TheComparisonSeesADifference) {
  const LrSchedule linear = make({.type = Type::kWarmupLR,
                                  .warmup_min_lr = 0.0001,
                                  .warmup_max_lr = 0.01,
                                  .warmup_num_steps = 10,
                                  .warmup_type = WarmupType::kLinear},
                                 0.001);
  EXPECT_NE(linear.lr_for_step(2), kWarmupLogLr[2]);
  const LrSchedule log = make({.type = Type::kWarmupLR,
                               .warmup_min_lr = 0.0001,
                               .warmup_max_lr = 0.01,
                               .warmup_num_steps = 10},
                              0.001);
  EXPECT_NE(log.lr_at(2), kWarmupLogLr[2]) << "step k runs at iteration k - 2, not k - 1";
}

TEST(LrSchedule, MissingRequiredParametersAreNamed) {
  struct Case {
    SchedulerConfig config;
    const char* key;
  };
  const Case cases[] = {
      {{.type = Type::kWarmupDecayLR}, "scheduler.params.total_num_steps: WarmupDecayLR requires"},
      {{.type = Type::kWarmupCosineLR}, "scheduler.params.total_num_steps: WarmupCosineLR"},
      {{.type = Type::kOneCycle, .cycle_max_lr = 0.1}, "scheduler.params.cycle_min_lr"},
      {{.type = Type::kOneCycle, .cycle_min_lr = 0.1}, "scheduler.params.cycle_max_lr"},
      {{.type = Type::kWarmupLR, .warmup_num_steps = 0},
       "scheduler.params.warmup_num_steps: expected a positive integer, got 0"},
      {{.type = Type::kOneCycle, .cycle_min_lr = 0, .cycle_max_lr = 1, .cycle_max_mom = 1.5},
       "scheduler.params.cycle_max_mom: expected a number in [0, 1)"},
  };
  for (const Case& c : cases) {
    Result<LrSchedule> s = LrSchedule::create(c.config, 0.001);
    ASSERT_FALSE(s.is_ok()) << c.key;
    EXPECT_THAT(s.status().message(), HasSubstr(c.key));
  }
}

}  // namespace
}  // namespace zinf::optim
