#include "zinf/config/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "zinf/core/log.h"

namespace zinf::config {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string data_path(const std::string& name) {
  return std::string(ZINF_CONFIG_TEST_DATA) + "/" + name;
}

Config load_ok(const std::string& name) {
  Result<Config> c = load_config(data_path(name));
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return c.is_ok() ? *c : Config{};
}

Config parse_ok(std::string_view text) {
  Result<Config> c = parse_config_text(text);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return c.is_ok() ? *c : Config{};
}

// Captures what the zinf logger writes while it lives.
class LogCapture {
 public:
  LogCapture()
      : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)),
        level_(log::logger().level()) {
    sink_->set_pattern("%l %v");
    log::logger().sinks().push_back(sink_);
    log::logger().set_level(spdlog::level::info);  // whatever ZINF_LOG_LEVEL says
  }
  ~LogCapture() {
    auto& sinks = log::logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    log::logger().set_level(level_);
  }
  std::vector<std::string> lines() const {
    std::vector<std::string> result;
    std::istringstream in(out_.str());
    for (std::string line; std::getline(in, line);) result.push_back(line);
    return result;
  }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  spdlog::level::level_enum level_;
};

// ---- defaults --------------------------------------------------------------------------------

TEST(Config, EmptyObjectGivesDeepSpeedDefaults) {
  Config c = parse_ok("{}");
  EXPECT_EQ(c, Config{});
  EXPECT_EQ(c.train_batch_size, 0);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 0.0f);
  EXPECT_EQ(c.optimizer.type, OptimizerConfig::Type::kAdam);
  EXPECT_EQ(c.optimizer.lr, 1e-3f);
  EXPECT_EQ(c.optimizer.beta1, 0.9f);
  EXPECT_EQ(c.optimizer.beta2, 0.999f);
  EXPECT_EQ(c.optimizer.eps, 1e-8f);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0f);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_TRUE(c.optimizer.bias_correction);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0f);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0f);
  EXPECT_FALSE(c.bf16);
  EXPECT_EQ(c.working_dtype(), DType::kF32);

  const ZeroConfig& z = c.zero;
  EXPECT_EQ(z.stage, 0);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 500'000'000u);
  EXPECT_EQ(z.sub_group_size, 1'000'000'000u);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000u);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000u);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000u);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_FALSE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_FALSE(z.offload_optimizer.pipeline_read);
  EXPECT_FALSE(z.offload_optimizer.pipeline_write);

  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);

  EXPECT_EQ(c.zinf.device_mem, 0u);
  EXPECT_EQ(c.zinf.host_mem, 0u);
  EXPECT_EQ(c.zinf.trace, "");
  EXPECT_EQ(c.zinf.seed, 0u);
  EXPECT_TRUE(c.zinf.checksum);  // on by default
  EXPECT_EQ(c.zinf.staging_bytes, 2u << 20);
  EXPECT_EQ(c.scheduler, SchedulerConfig{});
  EXPECT_EQ(c.scheduler.type, SchedulerConfig::Type::kNone);
  EXPECT_THAT(c.unknown_keys, IsEmpty());
  EXPECT_THAT(c.auto_keys, IsEmpty());
  EXPECT_THAT(c.ignored_keys, IsEmpty());
  EXPECT_THAT(c.given_keys, IsEmpty());
  EXPECT_TRUE(validate(c, 1).is_ok());
}

TEST(Config, OverlapCommDefaultsToTrueOnlyForStage3) {
  EXPECT_FALSE(parse_ok(R"({"zero_optimization": {"stage": 2}})").zero.overlap_comm);
  EXPECT_TRUE(parse_ok(R"({"zero_optimization": {"stage": 3}})").zero.overlap_comm);
  EXPECT_FALSE(
      parse_ok(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})").zero.overlap_comm);
  EXPECT_TRUE(
      parse_ok(R"({"zero_optimization": {"stage": 1, "overlap_comm": true}})").zero.overlap_comm);
}

TEST(Config, DesignatedInitializersBuildAValidConfig) {
  Config c{
      .train_micro_batch_size_per_gpu = 2,
      .gradient_accumulation_steps = 4,
      .bf16 = true,
      .zero = {.stage = 3,
               .overlap_comm = true,
               .offload_param = {.device = OffloadDevice::kCpu},
               .offload_optimizer = {
                   .device = OffloadDevice::kNvme, .nvme_path = {"/nvme"}, .buffer_count = 4}}};
  EXPECT_TRUE(validate(c, 8).is_ok());
  EXPECT_EQ(c.working_dtype(), DType::kBF16);
  ASSERT_TRUE(resolve_batch_sizes(c, 8).is_ok());
  EXPECT_EQ(c.train_batch_size, 64);
}

// ---- DeepSpeed example configs ---------------------------------------------------------------

TEST(Config, Zero2CpuOffloadExampleLoads) {
  Config c = load_ok("zero2_cpu_offload.json");
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 0);  // derived from the world size
  EXPECT_EQ(c.gradient_clipping, 1.0f);
  EXPECT_EQ(c.optimizer.type, OptimizerConfig::Type::kAdamW);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.optimizer.lr, 3e-5f);
  EXPECT_EQ(c.optimizer.beta1, 0.9f);
  EXPECT_EQ(c.optimizer.beta2, 0.95f);
  EXPECT_EQ(c.optimizer.weight_decay, 0.01f);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.working_dtype(), DType::kF16);
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(c.zero.offload_param.enabled());
  EXPECT_EQ(c.zero.reduce_bucket_size, 200'000'000u);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.scheduler.type, SchedulerConfig::Type::kWarmupLR);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 3e-5);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 500);
  EXPECT_EQ(c.scheduler.warmup_type, SchedulerConfig::WarmupType::kLog);  // DeepSpeed's default
  EXPECT_THAT(c.unknown_keys, IsEmpty());
  EXPECT_THAT(
      c.ignored_keys,
      ElementsAre("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                  "zero_optimization.allgather_bucket_size",
                  "zero_optimization.allgather_partitions",
                  "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
                  "zero_optimization.round_robin_gradients"));

  for (int world : {1, 2, 4, 8}) {
    Config resolved = c;
    ASSERT_TRUE(resolve_batch_sizes(resolved, world).is_ok()) << world;
    EXPECT_EQ(resolved.gradient_accumulation_steps, 8 / world);
  }
  Status s = validate(c, 16);  // 64 < 8 * 16
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.message(), HasSubstr("train_batch_size"));
  EXPECT_THAT(validate(c, 3).message(), HasSubstr("train_batch_size"));  // 64 != 8 * 2 * 3
}

TEST(Config, Zero3NvmeInfinityExampleLoads) {
  Config c = load_ok("zero3_nvme_infinity.json");
  EXPECT_EQ(c.train_batch_size, 0);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.optimizer.type, OptimizerConfig::Type::kAdam);
  EXPECT_TRUE(c.optimizer.adam_w_mode);  // DeepSpeed's Adam decays decoupled by default
  EXPECT_EQ(c.optimizer.lr, 1.5e-4f);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1f);
  EXPECT_TRUE(c.bf16);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.working_dtype(), DType::kBF16);

  const ZeroConfig& z = c.zero;
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.reduce_bucket_size, 50'000'000u);
  EXPECT_EQ(z.sub_group_size, 100'000'000u);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_THAT(z.offload_param.nvme_path, ElementsAre("/local_nvme"));
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_THAT(z.offload_optimizer.nvme_path, ElementsAre("/nvme0/zinf", "/nvme1/zinf"));
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_TRUE(z.offload_optimizer.pipeline_write);

  EXPECT_EQ(c.aio.block_size, 262144u);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);

  EXPECT_EQ(c.zinf.host_mem, 48ull << 30);
  EXPECT_EQ(c.zinf.device_mem, 16ull << 30);
  EXPECT_EQ(c.zinf.staging_bytes, 8u << 20);
  EXPECT_EQ(c.zinf.trace, "/tmp/zinf-trace.json");
  EXPECT_EQ(c.zinf.seed, 1234u);
  EXPECT_TRUE(c.zinf.checksum);
  EXPECT_THAT(c.unknown_keys, IsEmpty());

  ASSERT_TRUE(resolve_batch_sizes(c, 2).is_ok());
  EXPECT_EQ(c.train_batch_size, 64);
}

TEST(Config, HfTrainerAutoValuesTakeDefaultsAndAreListed) {
  Config c = load_ok("zero3_bf16_hf_auto.json");
  EXPECT_FALSE(c.bf16);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.optimizer.type, OptimizerConfig::Type::kAdamW);
  EXPECT_EQ(c.optimizer.lr, OptimizerConfig{}.lr);
  EXPECT_EQ(c.optimizer.beta2, OptimizerConfig{}.beta2);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.reduce_bucket_size, ZeroConfig{}.reduce_bucket_size);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, ZeroConfig{}.stage3_prefetch_bucket_size);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.train_batch_size, 0);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 0.0f);
  // The scheduler's "auto" parameters are left unset for the trainer to resolve.
  EXPECT_EQ(c.scheduler.type, SchedulerConfig::Type::kWarmupDecayLR);
  EXPECT_FALSE(c.scheduler.total_num_steps.has_value());
  EXPECT_FALSE(c.scheduler.warmup_max_lr.has_value());
  EXPECT_EQ(c.scheduler.warmup_num_steps, SchedulerConfig{}.warmup_num_steps);
  EXPECT_THAT(c.unknown_keys, IsEmpty());
  std::vector<std::string> autos = c.auto_keys;
  std::sort(autos.begin(), autos.end());
  EXPECT_THAT(autos,
              ElementsAre("bf16.enabled", "fp16.enabled", "gradient_accumulation_steps",
                          "gradient_clipping", "optimizer.params.betas", "optimizer.params.eps",
                          "optimizer.params.lr", "optimizer.params.weight_decay",
                          "scheduler.params.total_num_steps", "scheduler.params.warmup_max_lr",
                          "scheduler.params.warmup_min_lr", "scheduler.params.warmup_num_steps",
                          "train_batch_size", "train_micro_batch_size_per_gpu",
                          "zero_optimization.reduce_bucket_size",
                          "zero_optimization.stage3_param_persistence_threshold",
                          "zero_optimization.stage3_prefetch_bucket_size"));
  EXPECT_TRUE(validate(c, 4).is_ok());
}

TEST(Config, MinimalFp16ExampleDerivesTheMicroBatch) {
  Config c = load_ok("minimal_fp16.json");
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0f);  // dynamic
  EXPECT_EQ(c.zero.stage, 1);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 0);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  ASSERT_TRUE(resolve_batch_sizes(c, 4).is_ok());
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
}

TEST(Config, BatchSizesFollowDeepSpeedDerivation) {
  Config c = parse_ok(R"({"train_batch_size": 48, "gradient_accumulation_steps": 3})");
  ASSERT_TRUE(resolve_batch_sizes(c, 4).is_ok());
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);

  c = parse_ok(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})");
  ASSERT_TRUE(resolve_batch_sizes(c, 5).is_ok());
  EXPECT_EQ(c.train_batch_size, 30);

  c = parse_ok(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": 2})");
  EXPECT_TRUE(validate(c, 4).is_ok());
  Status s = validate(c, 2);
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.message(), HasSubstr("train_batch_size"));
  EXPECT_THAT(s.message(), HasSubstr("4 * gradient_accumulation_steps 2 * world size 2 = 16"));
  EXPECT_THAT(s.message(), HasSubstr("got 32"));

  c = parse_ok(R"({"train_batch_size": 2})");
  s = validate(c, 4);
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.message(), HasSubstr("train_batch_size: 2 is smaller"));
  EXPECT_THAT(validate(Config{}, 0).message(), HasSubstr("world size"));
}

// ---- unknown keys ----------------------------------------------------------------------------

TEST(Config, UnknownKeysAreCollectedWithPathsAndWarnedOnce) {
  LogCapture capture;
  Config c = parse_ok(R"({
    "optimiser": {"type": "Adam"},
    "fp16": {"enabled": true, "enabld": true},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}},
    "zero_optimization": {
      "stage": 3,
      "stage3_prefech_bucket_size": 1000,
      "offload_param": {"device": "cpu", "devcie": "nvme", "ratio": 0.5},
      "offload_optimizer": {"device": "cpu", "buffer_size": 100}
    },
    "aio": {"queue_dpth": 4},
    "zinf": {"host_memory": "1G"},
    "activation_checkpointing": {"partition_activations": true},
    "steps_per_print": 10
  })");
  EXPECT_THAT(
      c.unknown_keys,
      ElementsAre("activation_checkpointing", "aio.queue_dpth", "fp16.enabld", "optimiser",
                  "optimizer.params.max_grad_norm",
                  "zero_optimization.offload_optimizer.buffer_size",
                  "zero_optimization.offload_param.devcie", "zero_optimization.offload_param.ratio",
                  "zero_optimization.stage3_prefech_bucket_size", "zinf.host_memory"));
  int warnings = 0;
  for (const std::string& line : capture.lines()) {
    if (line.find("zinf does not know") == std::string::npos) continue;
    ++warnings;
    EXPECT_THAT(line, HasSubstr("warning"));
    EXPECT_THAT(line, HasSubstr("zero_optimization.stage3_prefech_bucket_size"));
    EXPECT_THAT(line, HasSubstr("zinf.host_memory"));
  }
  EXPECT_EQ(warnings, 1);
}

// DeepSpeed keys zinf accepts and does not act on: any value of the right JSON type, or "auto",
// is accepted (no range check: nothing uses the value), and ONE warning names those set.
TEST(Config, AcceptedButIgnoredKeysAreNamedInOneWarning) {
  LogCapture capture;
  Config c = parse_ok(R"({
    "train_batch_size": 16, "steps_per_print": 10, "wall_clock_breakdown": false,
    "zero_allow_untested_optimizer": true, "gradient_predivide_factor": 1.0,
    "prescale_gradients": false, "communication_data_type": "fp32",
    "fp16": {"enabled": true, "auto_cast": false, "consecutive_hysteresis": false},
    "bf16": {"enabled": false, "immediate_grad_update": true},
    "optimizer": {"type": "adamw", "params": {"torch_adam": true}},
    "zero_optimization": {
      "stage": 3, "round_robin_gradients": false,
      "stage3_gather_16bit_weights_on_model_save": "auto",
      "contiguous_gradients": false, "allgather_bucket_size": 0, "reduce_scatter": false,
      "allgather_partitions": true, "stage3_model_persistence_threshold": -1.5,
      "offload_param": {"device": "cpu", "buffer_size": 0},
      "offload_optimizer": {"device": "cpu", "pipeline": false, "fast_init": true}
    },
    "aio": {"overlap_events": false, "use_gds": true}
  })");
  EXPECT_THAT(c.unknown_keys, IsEmpty());
  EXPECT_THAT(
      c.ignored_keys,
      ElementsAre(
          "aio.overlap_events", "aio.use_gds", "bf16.immediate_grad_update",
          "communication_data_type", "fp16.auto_cast", "fp16.consecutive_hysteresis",
          "gradient_predivide_factor", "optimizer.params.torch_adam", "prescale_gradients",
          "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
          "zero_optimization.allgather_bucket_size", "zero_optimization.allgather_partitions",
          "zero_optimization.contiguous_gradients", "zero_optimization.offload_optimizer.fast_init",
          "zero_optimization.offload_param.buffer_size", "zero_optimization.reduce_scatter",
          "zero_optimization.round_robin_gradients",
          "zero_optimization.stage3_gather_16bit_weights_on_model_save",
          "zero_optimization.stage3_model_persistence_threshold"));
  int warnings = 0;
  for (const std::string& line : capture.lines()) {
    if (line.find("warning") == std::string::npos) continue;
    ++warnings;
    EXPECT_THAT(line, HasSubstr("21 DeepSpeed key(s) accepted but not acted on by zinf"));
    EXPECT_THAT(line, HasSubstr("aio.use_gds"));
    EXPECT_THAT(line, HasSubstr("zero_optimization.offload_param.buffer_size"));
  }
  EXPECT_EQ(warnings, 1) << capture.text();
  EXPECT_EQ(c.train_batch_size, 16);
  EXPECT_EQ(c.optimizer.type, OptimizerConfig::Type::kAdamW);  // case-insensitive
  EXPECT_EQ(to_json(c)["zero_optimization"].count("contiguous_gradients"), 0u)
      << "an ignored key is not part of the effective configuration";

  // Every listed key is in the catalogue (docs/configuration.md shows it with its reason).
  for (const std::string& key : c.ignored_keys) {
    EXPECT_TRUE(std::any_of(accepted_but_ignored_keys().begin(), accepted_but_ignored_keys().end(),
                            [&](const IgnoredKey& k) { return k.path == key; }))
        << key;
  }
  // offload_param.max_in_cpu is acted on (EngineSettings::param_max_in_cpu), not ignored.
  for (const IgnoredKey& k : accepted_but_ignored_keys()) {
    EXPECT_NE(k.path, "zero_optimization.offload_param.max_in_cpu");
    EXPECT_FALSE(k.why.empty()) << k.path;
  }
}

TEST(Config, AConfigWithoutIgnoredKeysDoesNotWarn) {
  LogCapture capture;
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                         "max_in_cpu": 5e8}}, "aio": {"queue_depth": 16}})");
  EXPECT_THAT(c.ignored_keys, IsEmpty());
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 500'000'000u);
  EXPECT_THAT(capture.text(), ::testing::Not(HasSubstr("warning")));
}

// given_keys: what the config sets, under the canonical path whatever name it used; "auto" and
// null are not "set".
TEST(Config, GivenKeysNameWhatTheConfigSets) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 5,
                         "cpu_offload": true, "reduce_bucket_size": "auto",
                         "overlap_comm": null},
                         "bfloat16": {"enabled": true}, "aio": {"thread_count": 2}})");
  for (const char* key :
       {"zero_optimization.stage", "zero_optimization.prefetch_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.cpu_offload",
        "zero_optimization.offload_optimizer.device", "bfloat16.enabled", "bf16.enabled",
        "aio.thread_count", "aio.intra_op_parallelism"}) {
    EXPECT_TRUE(config_sets(c, key)) << key;
  }
  for (const char* key : {"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
                          "fp16.enabled", "optimizer.params.lr"}) {
    EXPECT_FALSE(config_sets(c, key)) << key;
  }
  EXPECT_TRUE(std::is_sorted(c.given_keys.begin(), c.given_keys.end()));
}

// ---- values as DeepSpeed writes them -----------------------------------------------------------

TEST(Config, WholeFloatsAreIntegers) {
  Config c = parse_ok(R"({"zero_optimization": {"reduce_bucket_size": 5e8,
                         "sub_group_size": 1.25e9, "stage": 2.0},
                         "aio": {"queue_depth": 1.6e1}})");
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000u);
  EXPECT_EQ(c.zero.sub_group_size, 1'250'000'000u);
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.aio.queue_depth, 16);
}

TEST(Config, AliasesAndDeprecatedNames) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123,
                         "max_live_parameters": 7, "param_persistence_threshold": 0,
                         "max_reuse_distance": 0},
                         "aio": {"thread_count": 3}, "bfloat16": {"enabled": true}})");
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 123u);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 7u);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 0u);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 0u);
  EXPECT_EQ(c.aio.intra_op_parallelism, 3);
  EXPECT_TRUE(c.bf16);

  LogCapture capture;
  c = parse_ok(R"({"zero_optimization": {"stage": 3, "cpu_offload": true,
                  "cpu_offload_param": true, "cpu_offload_use_pin_memory": true}})");
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_THAT(capture.text(), HasSubstr("zero_optimization.cpu_offload is deprecated"));
}

TEST(Config, WeightDecayForm) {
  // DeepSpeed: Adam is decoupled (AdamW) unless adam_w_mode is false; AdamW is always decoupled.
  EXPECT_TRUE(parse_ok(R"({"optimizer": {"type": "Adam"}})").optimizer.adam_w_mode);
  EXPECT_FALSE(parse_ok(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})")
                   .optimizer.adam_w_mode);
  LogCapture capture;
  EXPECT_TRUE(parse_ok(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})")
                  .optimizer.adam_w_mode);
  EXPECT_THAT(capture.text(), HasSubstr("optimizer.params.adam_w_mode is false but type is AdamW"));
  EXPECT_FALSE(parse_ok(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})")
                   .optimizer.bias_correction);
}

TEST(Config, NullMeansAbsent) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3, "offload_param": null,
                         "overlap_comm": null}, "scheduler": null, "aio": null})");
  EXPECT_FALSE(c.zero.offload_param.enabled());
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.scheduler.type, SchedulerConfig::Type::kNone);
}

// ---- errors ----------------------------------------------------------------------------------

struct BadCase {
  const char* json;
  const char* key;       // the JSON path the message must name
  const char* expected;  // what the message must say was expected
};

class BadValue : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadValue, ErrorNamesTheKeyAndWhatWasExpected) {
  const BadCase& bad = GetParam();
  Result<Config> c = parse_config_text(bad.json);
  ASSERT_FALSE(c.is_ok()) << bad.json;
  EXPECT_EQ(c.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(bad.key)) << bad.json;
  EXPECT_THAT(c.status().message(), HasSubstr(bad.expected)) << bad.json;
}

// clang-format off
const BadCase kBadCases[] = {
  // wrong JSON types
  {R"({"zero_optimization": {"stage": "3"}})", "zero_optimization.stage", "expected an integer in 0..3, got \"3\" (a string)"},
  {R"({"zero_optimization": {"stage": "auto"}})", "zero_optimization.stage", "\"auto\" is not accepted here"},
  {R"({"zero_optimization": {"stage": 2.5}})", "zero_optimization.stage", "expected an integer in 0..3, got 2.5"},
  {R"({"zero_optimization": {"contiguous_gradients": "true"}})", "zero_optimization.contiguous_gradients", "expected true or false (the key has no effect in zinf)"},
  {R"({"zero_optimization": {"allgather_bucket_size": "5e8"}})", "zero_optimization.allgather_bucket_size", "expected a number (the key has no effect in zinf)"},
  {R"({"aio": {"use_gds": 1}})", "aio.use_gds", "expected true or false"},
  {R"({"tensorboard": true})", "tensorboard", "expected an object"},
  {R"({"bfloat16": {"enabled": true, "check_grad_overflow": 0}})", "bfloat16.check_grad_overflow", "expected true or false"},
  {R"({"zero_optimization": {"reduce_bucket_size": 1.5}})", "zero_optimization.reduce_bucket_size", "expected a non-negative integer, got 1.5"},
  {R"({"zero_optimization": {"sub_group_size": 1e20}})", "zero_optimization.sub_group_size", "expected a non-negative integer"},
  {R"({"zero_optimization": 3})", "zero_optimization", "expected an object, got 3"},
  {R"({"zero_optimization": {"offload_param": true}})", "zero_optimization.offload_param", "expected an object"},
  {R"({"fp16": {"enabled": 1}})", "fp16.enabled", "expected true or false, got 1"},
  {R"({"fp16": {"initial_scale_power": 1e10}})", "fp16.initial_scale_power", "expected a 32-bit integer"},
  {R"({"gradient_clipping": "1.0"})", "gradient_clipping", "expected a number in single-precision range"},
  {R"({"optimizer": {"type": "Adam", "params": {"lr": 1e39}}})", "optimizer.params.lr", "single-precision range"},
  {R"({"scheduler": 5})", "scheduler", "expected an object"},
  {R"({"scheduler": {"params": {}}})", "scheduler.type", "missing; expected one of the supported schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"},
  {R"({"scheduler": {"type": "CosineAnnealingLR"}})", "scheduler.type", "unsupported schedule \"CosineAnnealingLR\""},
  {R"({"scheduler": {"type": "warmuplr"}})", "scheduler.type", "unsupported schedule \"warmuplr\""},
  {R"({"scheduler": {"type": "auto"}})", "scheduler.type", "expected one of the supported schedules"},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})", "scheduler.params.total_num_steps", "not a parameter of WarmupLR; expected one of: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type"},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})", "scheduler.params.warmup_num_steps", "expected a positive integer, got 0"},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}})", "scheduler.params.warmup_num_steps", "expected"},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})", "scheduler.params.warmup_type", "expected \"log\" or \"linear\", got \"cosine\""},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "0.1"}}})", "scheduler.params.warmup_max_lr", "expected a number"},
  {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": -1}}})", "scheduler.params.warmup_min_lr", "expected a finite number >= 0, got -1"},
  {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})", "scheduler.params.total_num_steps", "missing; WarmupDecayLR requires it"},
  {R"({"scheduler": {"type": "WarmupCosineLR"}})", "scheduler.params.total_num_steps", "missing; WarmupCosineLR requires it"},
  {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 0}}})", "scheduler.params.total_num_steps", "expected a positive integer, got 0"},
  {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": -0.5}}})", "scheduler.params.cos_min_ratio", "expected a finite number >= 0"},
  {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}})", "scheduler.params.cycle_min_lr", "missing; OneCycle requires it"},
  {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}}})", "scheduler.params.cycle_first_step_size", "expected a finite number > 0, got 0"},
  {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_momentum": "yes"}}})", "scheduler.params.cycle_momentum", "expected true or false"},
  {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_max_mom": 1}}})", "scheduler.params.cycle_max_mom", "expected a number in [0, 1)"},
  {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "warmup_num_steps": 3}}})", "scheduler.params.warmup_num_steps", "not a parameter of OneCycle"},
  {R"({"zinf": {"host_mem": "4X"}})", "zinf.host_mem", "expected a byte count"},
  {R"({"zinf": {"trace": 5}})", "zinf.trace", "expected a string"},
  {R"({"zinf": {"seed": -1}})", "zinf.seed", "expected a non-negative integer, got -1"},
  {R"({"zinf": {"device_mem": 0}})", "zinf.device_mem (--device-mem)", "expected a positive byte count such as 2G, got 0; leave it out for a budget that fits the machine"},
  {R"({"zinf": {"host_mem": "0G"}})", "zinf.host_mem (--host-mem)", "expected a positive byte count such as 2G, got 0"},
  {"[1, 2]", "config", "expected a JSON object at the top level"},
  // ranges
  {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage (--stage)", "expected an integer in 0..3, got 4"},
  {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage", "expected an integer in 0..3, got -1"},
  {R"({"zero_optimization": {"reduce_bucket_size": -1}})", "zero_optimization.reduce_bucket_size", "expected a non-negative integer, got -1"},
  {R"({"zero_optimization": {"reduce_bucket_size": 0}})", "zero_optimization.reduce_bucket_size", "expected a positive number of elements, got 0"},
  {R"({"zero_optimization": {"stage3_prefetch_bucket_size": -5e7}})", "zero_optimization.stage3_prefetch_bucket_size", "expected a non-negative integer"},
  {R"({"train_batch_size": 0})", "train_batch_size", "expected a positive integer, got 0"},
  {R"({"train_micro_batch_size_per_gpu": -2})", "train_micro_batch_size_per_gpu", "expected a positive integer, got -2"},
  {R"({"gradient_accumulation_steps": 0})", "gradient_accumulation_steps", "expected a positive integer, got 0"},
  {R"({"gradient_clipping": -1})", "gradient_clipping", "expected a finite number >= 0"},
  {R"({"optimizer": {"type": "Adam", "params": {"lr": -0.1}}})", "optimizer.params.lr", "expected a finite number >= 0"},
  {R"({"optimizer": {"type": "Adam", "params": {"eps": 0}}})", "optimizer.params.eps", "expected a finite number > 0, got 0"},
  {R"({"optimizer": {"type": "Adam", "params": {"eps": -1e-8}}})", "optimizer.params.eps", "expected a finite number > 0"},
  {R"({"optimizer": {"type": "Adam", "params": {"weight_decay": -0.1}}})", "optimizer.params.weight_decay", "expected a finite number >= 0"},
  {R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})", "optimizer.params.betas", "expected an array of two numbers in [0, 1)"},
  {R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}})", "optimizer.params.betas", "expected an array of two numbers in [0, 1), got [0.9,1.0]"},
  {R"({"optimizer": {"type": "Adam", "params": {"betas": [-0.1, 0.99]}}})", "optimizer.params.betas", "in [0, 1)"},
  {R"({"optimizer": {"type": "Adam", "params": {"betas": "0.9,0.99"}}})", "optimizer.params.betas", "in [0, 1)"},
  {R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, "0.99"]}}})", "optimizer.params.betas", "in [0, 1)"},
  {R"({"optimizer": {"type": "Lamb"}})", "optimizer.type", "unsupported optimizer \"Lamb\"; expected one of the supported optimizers: Adam, AdamW"},
  {R"({"optimizer": {"type": 1}})", "optimizer.type", "Adam, AdamW"},
  {R"({"optimizer": {"params": {"lr": 0.1}}})", "optimizer.type", "missing; expected one of the supported optimizers: Adam, AdamW"},
  {R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", "optimizer.params.amsgrad", "expected false"},
  {R"({"fp16": {"loss_scale": -1}})", "fp16.loss_scale", "expected a number >= 0"},
  {R"({"fp16": {"initial_scale_power": 200}})", "fp16.initial_scale_power", "expected an integer in 0..127"},
  {R"({"fp16": {"loss_scale_window": 0}})", "fp16.loss_scale_window", "expected an integer >= 1"},
  {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis", "expected an integer >= 1"},
  {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale", "expected a number > 0"},
  {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth", "expected an integer >= 1, got 0"},
  {R"({"aio": {"block_size": 1000}})", "aio.block_size", "expected a positive multiple of 4096 bytes, got 1000"},
  {R"({"aio": {"block_size": 0}})", "aio.block_size", "multiple of 4096"},
  {R"({"aio": {"intra_op_parallelism": 0}})", "aio.intra_op_parallelism", "expected an integer >= 1"},
  {R"({"zinf": {"staging_bytes": 1000}})", "zinf.staging_bytes", "multiple of 1 MiB"},
  {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}})", "zero_optimization.offload_param.buffer_count", "expected an integer >= 1"},
  {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}})", "zero_optimization.offload_optimizer.ratio", "expected a fraction in (0, 1], got 0"},
  {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})", "zero_optimization.offload_optimizer.ratio", "expected a fraction in (0, 1]"},
  {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})", "zero_optimization.offload_param.device", "expected one of \"none\", \"cpu\", \"nvme\", got \"gpu\""},
  {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": 5}}})", "zero_optimization.offload_param.nvme_path", "expected a directory path or a list of directory paths"},
  {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ["/a", 7]}}})", "zero_optimization.offload_param.nvme_path[1]", "expected a directory path (a string)"},
  // impossible combinations
  {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "fp16.enabled and bf16.enabled", "only one 16-bit working precision"},
  {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})", "zero_optimization.offload_param.device (--offload-param)", "parameter offload needs zero_optimization.stage 3 (--stage 3), got device \"cpu\" with stage 2"},
  {R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}})", "zero_optimization.offload_param.device", "needs zero_optimization.stage 3"},
  {R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})", "zero_optimization.offload_optimizer.device", "optimizer offload needs zero_optimization.stage 1, 2 or 3"},
  {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})", "zero_optimization.offload_optimizer.ratio", "partial optimizer offload (ratio < 1) needs zero_optimization.stage 3"},
  {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})", "zero_optimization.offload_param.nvme_path (--nvme-path DIR)", "expected a directory on the NVMe file system (or a list of them) for device \"nvme\" (--offload-param nvme), got none"},
  {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": []}}})", "zero_optimization.offload_optimizer.nvme_path", "for device \"nvme\" (--offload-optimizer nvme), got none"},
  {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ""}}})", "zero_optimization.offload_optimizer.nvme_path[0]", "expected a non-empty directory path"},
  {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", ""]}}})", "zero_optimization.offload_optimizer.nvme_path[1]", "expected a non-empty directory path"},
  {R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})", "zero_optimization.stage3_prefetch_bucket_size and zero_optimization.prefetch_bucket_size", "expected only one of them"},
  {R"({"aio": {"thread_count": 2, "intra_op_parallelism": 2}})", "aio.intra_op_parallelism and aio.thread_count", "expected only one of them"},
  {R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})", "bf16 and bfloat16", "expected only one of them"},
  {R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})", "zero_optimization.cpu_offload (deprecated) and zero_optimization.offload_optimizer", "expected only zero_optimization.offload_optimizer"},
  {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}})", "zero_optimization.stage", "appears twice"},
  {R"({"a": [{"x": 1, "x": 2}]})", "a[0].x", "appears twice"},
};
// clang-format on

INSTANTIATE_TEST_SUITE_P(Config, BadValue, ::testing::ValuesIn(kBadCases));

TEST(Config, ValidateAppliesTheSameRulesToConfigsBuiltInCode) {
  Config c;
  c.aio.queue_depth = 0;
  EXPECT_THAT(validate(c, 1).message(), HasSubstr("aio.queue_depth"));
  c = Config{.zero = {.stage = 1, .offload_param = {.device = OffloadDevice::kCpu}}};
  EXPECT_THAT(validate(c, 1).message(), HasSubstr("zero_optimization.offload_param.device"));
  c = Config{.optimizer = {.type = OptimizerConfig::Type::kAdamW, .adam_w_mode = false}};
  EXPECT_THAT(validate(c, 1).message(), HasSubstr("optimizer.params.adam_w_mode"));
  c = Config{.train_micro_batch_size_per_gpu = 0};
  EXPECT_THAT(validate(c, 1).message(), HasSubstr("train_micro_batch_size_per_gpu"));
}

TEST(Config, JsonSyntaxErrorNamesLineAndColumn) {
  Result<Config> c = parse_config_text("{\n  \"zero_optimization\": {\n    \"stage\": 3,\n  }\n}");
  ASSERT_FALSE(c.is_ok());
  EXPECT_THAT(c.status().message(), HasSubstr("not valid JSON: line 4, column 3"));
  EXPECT_THAT(c.status().message(), ::testing::Not(HasSubstr("[json.exception")));

  c = parse_config_text("{\"stage\": 3");
  ASSERT_FALSE(c.is_ok());
  EXPECT_THAT(c.status().message(), HasSubstr("line 1"));
}

TEST(Config, LoadConfigNamesAMissingOrUnreadableFile) {
  Result<Config> c = load_config(data_path("no_such_config.json"));
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), ErrorCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("no_such_config.json"));
  EXPECT_THAT(c.status().detail(), HasSubstr("No such file"));

  c = load_config(data_path(""));  // a directory
  ASSERT_FALSE(c.is_ok());
  EXPECT_THAT(c.status().message(), HasSubstr(ZINF_CONFIG_TEST_DATA));
}

// Hostile documents: bounded depth, numbers out of range named, FIFOs refused without waiting.
TEST(Config, DeepNestingAndHugeNumbersAreClearErrors) {
  std::string deep;
  for (int i = 0; i < 20000; ++i) deep += R"({"a":)";
  deep += "1";
  deep.append(20000, '}');
  Result<Config> c = parse_config_text(deep);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("deeper than 64 levels"));

  c = parse_config_text(R"({"optimizer": {"type": "Adam", "params": {"lr": 1e400}}})");
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("config is not valid: number overflow"));
  EXPECT_THAT(c.status().message(), HasSubstr("1e400"));

  const std::string fifo = ::testing::TempDir() + "/zinf_config_fifo";
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  c = load_config(fifo);  // returns at once: nothing waits for a writer
  ASSERT_FALSE(c.is_ok());
  EXPECT_THAT(c.status().message(), HasSubstr("is not a regular file"));
  std::remove(fifo.c_str());
}

TEST(Config, LoadConfigPutsTheFileInFrontOfAValueError) {
  std::string path = ::testing::TempDir() + "/zinf_bad_config.json";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(R"({"zero_optimization": {"stage": 7}})", f);
    std::fclose(f);
  }
  Result<Config> c = load_config(path);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().message(),
            "config file " + path +
                ": zero_optimization.stage (--stage): expected an integer in 0..3, got 7");
  std::remove(path.c_str());
}

// ---- round trip and logging ------------------------------------------------------------------

Config without_parse_notes(Config c) {
  c.unknown_keys.clear();
  c.auto_keys.clear();
  c.ignored_keys.clear();
  c.given_keys.clear();
  return c;
}

void expect_round_trip(const Config& original) {
  json j = to_json(original);
  Result<Config> again = parse_config(j);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string() << "\n" << j.dump(2);
  EXPECT_EQ(without_parse_notes(*again), without_parse_notes(original)) << j.dump(2);
  EXPECT_THAT(again->unknown_keys, IsEmpty()) << j.dump(2);
  // Through text as well: what log lines and files carry.
  Result<Config> from_text = parse_config_text(j.dump());
  ASSERT_TRUE(from_text.is_ok()) << from_text.status().to_string();
  EXPECT_EQ(without_parse_notes(*from_text), without_parse_notes(original));
}

TEST(Config, ToJsonRoundTrips) {
  for (const char* name : {"zero2_cpu_offload.json", "zero3_nvme_infinity.json",
                           "zero3_bf16_hf_auto.json", "minimal_fp16.json"}) {
    SCOPED_TRACE(name);
    expect_round_trip(load_ok(name));
  }
  expect_round_trip(Config{});
  Config odd{.train_batch_size = 96,
             .train_micro_batch_size_per_gpu = 0,
             .gradient_accumulation_steps = 3,
             .gradient_clipping = 0.3f,
             .optimizer = {.type = OptimizerConfig::Type::kAdam,
                           .lr = 7e-7f,
                           .beta1 = 0.8f,
                           .beta2 = 0.95f,
                           .eps = 1e-6f,
                           .weight_decay = 0.05f,
                           .adam_w_mode = false,
                           .bias_correction = false},
             .fp16 = {.enabled = true, .loss_scale = 128, .min_loss_scale = 0.25f},
             .zero = {.stage = 3,
                      .overlap_comm = false,
                      .sub_group_size = 0,
                      .offload_param = {.device = OffloadDevice::kCpu, .pin_memory = true},
                      .offload_optimizer = {.device = OffloadDevice::kNvme,
                                            .nvme_path = {"/a", "/b", "/c"},
                                            .buffer_count = 6,
                                            .pipeline_read = true,
                                            .ratio = 0.3}},
             .aio = {.block_size = 8192, .single_submit = true},
             .zinf = {.device_mem = 1, .trace = "t.json", .seed = ~0ull, .checksum = true},
             .scheduler = {.type = SchedulerConfig::Type::kOneCycle,
                           .cycle_min_lr = 1e-4,
                           .cycle_max_lr = 0.25,
                           .cycle_second_step_size = 0,
                           .cycle_second_stair_count = 3,
                           .cycle_momentum = false}};
  expect_round_trip(odd);
}

TEST(Config, LogEffectiveConfigShowsEveryBlock) {
  Config c = load_ok("zero3_bf16_hf_auto.json");
  LogCapture capture;
  log_effective_config(c);
  std::string text = capture.text();
  EXPECT_THAT(text, HasSubstr("working_dtype=fp32"));
  EXPECT_THAT(text, HasSubstr("config zero_optimization:"));
  EXPECT_THAT(text, HasSubstr("stage=3"));
  EXPECT_THAT(text, HasSubstr("offload_param.device=\"cpu\""));
  EXPECT_THAT(text, HasSubstr("config aio: block_size=1048576"));
  EXPECT_THAT(text, HasSubstr("config optimizer:"));
  EXPECT_THAT(text, HasSubstr("params.lr=0.001"));
  EXPECT_THAT(text, HasSubstr("config zinf:"));
  EXPECT_THAT(text, HasSubstr("\"auto\" (left to the trainer; until resolved, the default) for: "));
  EXPECT_THAT(text, HasSubstr("zero_optimization.reduce_bucket_size"));
}

}  // namespace
}  // namespace zinf::config
