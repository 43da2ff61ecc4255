// `zinf train --config ds.json --log-json log` with a DeepSpeed "scheduler" block trains with that
// schedule: the lr (and, for OneCycle, the betas) each step logs is DeepSpeed's formula at that
// step. The formulas are written out here from deepspeed/runtime/lr_schedules.py, independently
// of zinf/optim/lr_schedule.h. DeepSpeed builds the schedule before the first step (iteration -1)
// and steps it after every applied step, so step k runs at iteration (applied steps before it) - 1;
// a skipped step (fp16 overflow) does not advance it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

using nlohmann::json;

struct Logged {
  std::vector<json> steps;
  json settings;
};

// Runs zinf train with `config` and `flags`; the --log-json lines.
Logged train(const std::string& name, const json& config, const std::string& flags) {
  const std::string dir = std::string(ZINF_TEST_OUT) + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/ds.json") << config.dump(2);
  const std::string cmd = std::string(ZINF_BIN) + " train --model tiny --quiet --config " + dir +
                          "/ds.json --log-json " + dir + "/log.jsonl " + flags;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  Logged out;
  std::ifstream in(dir + "/log.jsonl");
  for (std::string line; std::getline(in, line);) {
    json j = json::parse(line);
    if (j.contains("settings")) out.settings = j;
    if (j.contains("step")) out.steps.push_back(j);
  }
  return out;
}

// Every logged step's lr against `lr_at(iteration)`, the iteration counting applied steps.
void expect_schedule(const Logged& log, size_t steps, const std::function<double(int64_t)>& lr_at,
                     const std::function<double(int64_t)>& beta1_at = {}) {
  ASSERT_EQ(log.steps.size(), steps);
  int64_t applied = 0;
  for (const json& s : log.steps) {
    SCOPED_TRACE("step " + s["step"].dump());
    const double want = lr_at(applied - 1);
    // The optimizer runs in fp32: the logged lr is DeepSpeed's value rounded to float.
    EXPECT_NEAR(s["lr"].get<double>(), want, 1e-7 * std::abs(want) + 1e-15);
    if (beta1_at) {
      EXPECT_NEAR(s["beta1"].get<double>(), beta1_at(applied - 1), 1e-7);
      EXPECT_NEAR(s["beta2"].get<double>(), 0.99, 1e-7);
    }
    if (!s["skipped"].get<bool>()) ++applied;
  }
}

constexpr double kPi = 3.14159265358979323846;

// WarmupCosineLR with a log warm-up, fp16 (dynamic loss scaling: a skipped step holds the lr), two
// ranks, ZeRO-2 with the optimizer in host memory.
TEST(TrainSchedule, WarmupCosineLrFromADeepSpeedConfig) {
  const double lr = 0.01, min_ratio = 0.1, cos_min = 0.02;
  const int64_t warmup = 4, total = 12;
  const json config = {
      {"train_micro_batch_size_per_gpu", 2},
      {"fp16",
       {{"enabled", true},
        {"initial_scale_power", 24},
        {"hysteresis", 1}}},  // the first steps overflow
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", lr}}}}},
      {"scheduler",
       {{"type", "WarmupCosineLR"},
        {"params",
         {{"total_num_steps", total},
          {"warmup_num_steps", warmup},
          {"warmup_min_ratio", min_ratio},
          {"cos_min_ratio", cos_min}}}}},
      {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  const Logged log = train("cosine", config, "--steps 24 --ranks 2");
  EXPECT_EQ(log.settings["settings"]["lr_schedule"], "WarmupCosineLR");
  EXPECT_EQ(log.settings["set_by"]["lr_schedule"], "config");
  ASSERT_EQ(log.steps.size(), 24u);
  EXPECT_TRUE(log.steps[0]["skipped"].get<bool>()) << "a loss scale of 2^24 overflows fp16";
  EXPECT_FALSE(log.steps[23]["skipped"].get<bool>());
  expect_schedule(log, 24, [&](int64_t i) {
    if (i < 0) return 0.0;
    double ratio;
    if (i < warmup) {
      ratio = std::log(static_cast<double>(i + 1)) / std::log(static_cast<double>(warmup));
      ratio = min_ratio + ratio * (1 - min_ratio);
    } else {
      const double progress =
          std::min(1.0, static_cast<double>(i - warmup + 1) /
                            static_cast<double>(std::max<int64_t>(1, total - warmup)));
      ratio = std::max(0.0, cos_min + (1 - cos_min) * (1 + std::cos(kPi * progress)) / 2);
    }
    return lr * ratio;
  });
}

// OneCycle with momentum cycling and decay after the cycle; ZeRO-3 on one rank.
TEST(TrainSchedule, OneCycleWithMomentumFromADeepSpeedConfig) {
  const double lo = 0.001, hi = 0.01, first = 3, second = 5, decay_rate = 0.5, decay_size = 2,
               mom_lo = 0.85, mom_hi = 0.95, mom_rate = 0.01;
  const json config = {{"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.5}}}}},
                       {"scheduler",
                        {{"type", "OneCycle"},
                         {"params",
                          {{"cycle_min_lr", lo},
                           {"cycle_max_lr", hi},
                           {"cycle_first_step_size", first},
                           {"cycle_second_step_size", second},
                           {"decay_lr_rate", decay_rate},
                           {"decay_step_size", decay_size},
                           {"cycle_min_mom", mom_lo},
                           {"cycle_max_mom", mom_hi},
                           {"decay_mom_rate", mom_rate}}}}},
                       {"zero_optimization", {{"stage", 3}}}};
  const Logged log = train("onecycle", config, "--steps 12");
  const double total = first + second, ratio = first / total;
  auto scale = [&](int64_t i) {
    const double b = static_cast<double>(i + 1);
    const double x = 1 + b / total - std::floor(1 + b / total);
    return x <= ratio ? x / ratio : (x - 1) / (ratio - 1);
  };
  expect_schedule(
      log, 12,
      [&](int64_t i) {
        if (static_cast<double>(i) < total) return lo + (hi - lo) * scale(i);
        return lo / (1 + decay_rate * ((static_cast<double>(i) - total + 1) / decay_size));
      },
      [&](int64_t i) {
        if (i < 0) return mom_lo;  // set when DeepSpeed builds the schedule
        if (static_cast<double>(i) < total) return mom_hi - (mom_hi - mom_lo) * scale(i);
        return mom_hi * (1 + mom_rate * ((static_cast<double>(i) - total + 1) / decay_size));
      });
}

// The Hugging Face integration's config: every "auto" resolved from the run, the schedule from
// the flags (--lr, --warmup-steps, --steps), the log's first line saying so.
TEST(TrainSchedule, AutoValuesComeFromTheRun) {
  std::ifstream in(std::string(ZINF_CONFIG_DATA) + "/zero3_bf16_hf_auto.json");
  const json config = json::parse(in);
  const Logged log = train("hf_auto", config, "--steps 6 --lr 0.02 --warmup-steps 3");
  const json& autos = log.settings["auto"];
  EXPECT_EQ(autos["zero_optimization.reduce_bucket_size"], "1024 (hidden^2, hidden 32)");
  EXPECT_EQ(autos["scheduler.params.total_num_steps"], "6 (--steps)");
  EXPECT_EQ(autos["optimizer.params.lr"], "0.02 (--lr)");
  EXPECT_EQ(log.settings["settings"]["reduce_bucket_elements"], 1024);
  // WarmupDecayLR, log warm-up from 0 to the lr over 3 steps, then linear to 0 at step 6.
  expect_schedule(log, 6, [](int64_t i) {
    if (i < 0) return 0.0;
    const double gamma = i < 3 ? std::log(static_cast<double>(i + 1)) / std::log(3.0)
                               : std::max(0.0, (6.0 - static_cast<double>(i)) / 3.0);
    return 0.02 * gamma;
  });
}

}  // namespace
