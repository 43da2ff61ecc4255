// settings_from_config: every DeepSpeed key zinf acts on reaches the engine setting it names.
#include "zinf/engine/settings.h"

#include <gtest/gtest.h>

#include "zinf/config/config.h"

namespace zinf {
namespace {

EngineSettings settings_of(const char* json) {
  auto c = config::parse_config_text(json);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  auto s = settings_from_config(*c);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return *s;
}

TEST(Settings, InfinityConfigReachesTheEngine) {
  EngineSettings s = settings_of(R"({
    "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "zero_optimization": {
      "stage": 3, "overlap_comm": true, "reduce_bucket_size": 5e7, "sub_group_size": 1e8,
      "stage3_prefetch_bucket_size": 4e7, "stage3_param_persistence_threshold": 1e5,
      "stage3_max_live_parameters": 3e8, "stage3_max_reuse_distance": 2e8,
      "offload_param": {"device": "nvme", "nvme_path": "/a", "pin_memory": true,
                        "buffer_count": 6},
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b"], "buffer_count": 4,
                            "pipeline_read": true, "pipeline_write": false, "ratio": 0.5}},
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2,
            "single_submit": true},
    "zinf": {"host_mem": "1G", "device_mem": "2G", "staging_bytes": "8M", "checksum": false,
             "overlap_optimizer": true, "seed": 7}})");
  EXPECT_EQ(s.stage, 3);
  EXPECT_EQ(s.dtype, DType::kBF16);
  EXPECT_EQ(s.gradient_clipping, 1.0f);
  EXPECT_TRUE(s.overlap_comm);
  EXPECT_EQ(s.reduce_bucket_elements, 50'000'000u);
  EXPECT_EQ(s.sub_group_elements, 100'000'000u);
  EXPECT_EQ(s.prefetch_bucket_elements, 40'000'000u);
  EXPECT_EQ(s.param_persistence_threshold, 100'000u);
  EXPECT_EQ(s.max_live_elements, 300'000'000u);
  EXPECT_EQ(s.max_reuse_distance, 200'000'000u);
  EXPECT_EQ(s.param_home, Tier::kNvme);
  EXPECT_EQ(s.optimizer_home, Tier::kNvme);
  EXPECT_EQ(s.nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(s.optimizer_offload_ratio, 0.5);
  EXPECT_TRUE(s.pin_memory);
  EXPECT_EQ(s.staging_buffers, 6u) << "offload_param.buffer_count: parameters move to the device";
  EXPECT_TRUE(s.pipeline_read);
  EXPECT_FALSE(s.pipeline_write);
  EXPECT_EQ(s.io_block_size, 262144u);
  EXPECT_EQ(s.io_queue_depth, 16u);
  EXPECT_EQ(s.io_rings, 2u);
  EXPECT_TRUE(s.io_single_submit);
  EXPECT_EQ(s.host_mem, 1ull << 30);
  EXPECT_EQ(s.device_mem, 2ull << 30);
  EXPECT_EQ(s.staging_bytes, 8u << 20);
  EXPECT_FALSE(s.checksum);  // on by default: the config turns it off
  EXPECT_TRUE(s.overlap_optimizer);
  EXPECT_EQ(s.seed, 7u);
}

TEST(Settings, DeepSpeedDefaultsAreDeepSpeeds) {
  EngineSettings s = settings_of(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_EQ(s.optimizer_home, Tier::kHost);
  EXPECT_EQ(s.param_home, Tier::kDevice);
  EXPECT_EQ(s.prefetch_bucket_elements, 50'000'000u);
  EXPECT_EQ(s.max_live_elements, 1'000'000'000u);
  EXPECT_EQ(s.max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(s.sub_group_elements, 1'000'000'000u);
  // DeepSpeed's offload defaults: not pinned, no optimizer pipelining, 4 buffers.
  EXPECT_FALSE(s.pin_memory);
  EXPECT_FALSE(s.pipeline_read);
  EXPECT_FALSE(s.pipeline_write);
  EXPECT_EQ(s.staging_buffers, 4u);
  EXPECT_FALSE(s.overlap_optimizer);
  EXPECT_FALSE(s.io_single_submit);
}

}  // namespace
}  // namespace zinf
