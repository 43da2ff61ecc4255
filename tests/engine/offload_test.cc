// Offload through the tiered store: optimizer states and parameters homed on the host or on
// NVMe give the same bits as keeping everything on the device.
#include <gtest/gtest.h>

#include <cstring>

#include "../io/test_dir.h"
#include "mlp.h"

namespace zinf {
namespace {

using testing::RunResult;
using testing::same_bits;
using testing::train_local;

struct Mode {
  const char* name;
  Tier params;
  Tier optimizer;
};

TEST(Offload, EveryModeIsBitIdenticalToNoOffload) {
  zinf::testing::TempDir nvme;
  const Mode modes[] = {{"optimizer cpu", Tier::kDevice, Tier::kHost},
                        {"optimizer nvme", Tier::kDevice, Tier::kNvme},
                        {"params cpu", Tier::kHost, Tier::kDevice},
                        {"params nvme", Tier::kNvme, Tier::kDevice},
                        {"both nvme", Tier::kNvme, Tier::kNvme}};
  for (int world : {1, 2, 4}) {
    for (int stage : {1, 2, 3}) {
      EngineSettings s;
      s.stage = stage;
      s.adam.lr = 0.01f;
      s.gradient_clipping = 0.5f;
      RunResult reference = train_local(s, world, 3, 2);
      ASSERT_TRUE(reference.status.is_ok()) << reference.status.to_string();
      for (const Mode& m : modes) {
        if (m.params != Tier::kDevice && stage != 3) continue;
        EngineSettings o = s;
        o.param_home = m.params;
        o.optimizer_home = m.optimizer;
        o.nvme_paths = {nvme.path()};
        RunResult r = train_local(o, world, 3, 2);
        ASSERT_TRUE(r.status.is_ok()) << m.name << ": " << r.status.to_string();
        EXPECT_TRUE(same_bits(reference, r))
            << m.name << " differs at stage " << stage << " world " << world;
        if (m.params == Tier::kNvme || m.optimizer == Tier::kNvme) {
          EXPECT_GT(r.memory[0].tiers[static_cast<int>(Tier::kNvme)].peak, 0u) << m.name;
        }
      }
    }
  }
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// Partial offload (Twin-Flow ratio): some units' optimizer state on the host, the rest on the
// device; same bits.
TEST(Offload, PartialRatioSplitsTheOptimizerAndKeepsTheBits) {
  testing::MlpShape shape{.dims = {32, 256, 256, 256, 8}};
  for (int stage : {1, 3}) {
    EngineSettings s;
    s.stage = stage;
    s.adam.lr = 0.01f;
    s.gradient_clipping = 0.5f;
    RunResult reference = train_local(s, 2, 3, 2, shape);
    ASSERT_TRUE(reference.status.is_ok());
    EngineSettings p = s;
    p.optimizer_home = Tier::kHost;
    p.optimizer_offload_ratio = 0.5;
    RunResult r = train_local(p, 2, 3, 2, shape);
    ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
    EXPECT_TRUE(same_bits(reference, r)) << "stage " << stage;
    const auto& device = r.memory[0].tiers[static_cast<int>(Tier::kDevice)];
    const auto& host = r.memory[0].tiers[static_cast<int>(Tier::kHost)];
    const int kOptimizer = static_cast<int>(MemoryCategory::kOptimizerStates);
    EXPECT_GT(device.current_by_category[kOptimizer], 0u) << "stage " << stage;
    EXPECT_GT(host.current_by_category[kOptimizer], 0u) << "stage " << stage;
  }
}

TEST(Offload, BudgetsHoldWhileTheStateIsSeveralTimesLarger) {
  zinf::testing::TempDir nvme;
  testing::MlpShape shape{.dims = {64, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 8}};
  const int world = 2;
  uint64_t P = 0;
  for (auto& u : testing::mlp_units(shape)) {
    P += zero::make_shard_layout(u, world, DType::kF32)->numel_padded;
  }
  const uint64_t state_bytes = 16 * P;  // params, grads, m, v in fp32
  EngineSettings s;
  s.stage = 3;
  s.adam.lr = 0.01f;
  s.param_home = Tier::kNvme;
  s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  s.staging_bytes = 1 << 20;
  s.staging_buffers = 2;
  s.device_mem = 14 << 20;  // one gathered unit, its gradients and shards
  s.host_mem = 30 << 20;    // staging, gradient shards, two units of optimizer state
  RunResult r = train_local(s, world, 2, 2, shape);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  EXPECT_GT(state_bytes, 3 * s.device_mem);
  EXPECT_GT(state_bytes, 3 * s.host_mem);
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_LE(r.memory[rank].tiers[static_cast<int>(Tier::kDevice)].peak, s.device_mem);
    EXPECT_LE(r.memory[rank].tiers[static_cast<int>(Tier::kHost)].peak, s.host_mem);
    // NVMe holds this rank's whole training state: parameter shard, gradient shard, m and v.
    EXPECT_EQ(r.memory[rank].tiers[static_cast<int>(Tier::kNvme)].current, state_bytes / world);
  }
  // And the same bits as with everything resident.
  EngineSettings plain;
  plain.stage = 3;
  plain.adam.lr = 0.01f;
  RunResult ref = train_local(plain, world, 2, 2, shape);
  ASSERT_TRUE(ref.status.is_ok());
  EXPECT_TRUE(same_bits(ref, r));
}

}  // namespace
}  // namespace zinf

#include "zinf/io/fault.h"

namespace zinf {
namespace {

// An I/O error while swapping stops the step with an error naming the tensor and the file;
// nothing is lost (the data stays valid in memory) and training continues after the fault clears,
// ending on the same bits as a run that never saw the fault.
// With the update behind step() (update_behind, the default here) the failed write-back may come
// after step() returned (one of the walk's): the next step() reports it then.
TEST(Offload, SwapFaultIsReportedAndTrainingContinues) {
  for (const bool behind : {false, true}) {
    SCOPED_TRACE(behind ? "update behind step()" : "update inside step()");
    zinf::testing::TempDir nvme;
    EngineSettings s;
    s.stage = 3;
    s.adam.lr = 0.01f;
    s.param_home = Tier::kNvme;
    s.optimizer_home = Tier::kNvme;
    s.nvme_paths = {nvme.path()};
    s.update_behind = behind;
    // One unit on the device at a time: with room for all three the shards would stay there
    // between passes and their host room would keep all the state (nothing written to fail).
    s.param_persistence_threshold = 0;
    s.device_mem = 20 << 10;  // a unit (2048 padded parameters) and its gradients, and 4 KiB
    RunResult clean = train_local(s, 1, 4, 2);
    ASSERT_TRUE(clean.status.is_ok()) << clean.status.to_string();

    auto group = comm::make_local_group(1).value();
    auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
    std::vector<uint64_t> samples = {0, 1};
    int failed_steps = 0;
    for (int step = 0; step < 4; ++step) {
      ASSERT_TRUE(testing::mlp_micro_step(*engine, {}, samples).is_ok());
      if (step == 1) {
        io::FaultInjector::global().add(
            {.op = io::IoOp::kWrite, .nth = 1, .kind = io::FaultKind::kEio});
      }
      Status st = engine->step();
      if (step == 1 && st.is_ok()) {
        ASSERT_TRUE(engine->wait_for_update().is_ok())
            << "a write-back failure is not the update's";
      }
      io::FaultInjector::global().clear();
      if (!st.is_ok()) {
        EXPECT_TRUE(step == 1 || (behind && step == 2)) << step << ": " << st.message();
        EXPECT_NE(st.message().find("writing tensor layer"), std::string::npos) << st.message();
        EXPECT_NE(st.message().find("swap-"), std::string::npos) << st.message();
        ++failed_steps;
      }
    }
    EXPECT_EQ(failed_steps, 1);
    for (size_t u = 0; u < engine->unit_count(); ++u) {
      auto p = engine->full_parameters(u);
      ASSERT_TRUE(p.is_ok());
      EXPECT_EQ(std::memcmp(p->data(), clean.params[u].data(), p->size() * 4), 0) << "unit " << u;
    }
  }
}

// A swap block that changes behind zinf's back (the disk, another process) is caught by its
// checksum with the default settings: an error naming the tensor and the offset, not training on
// corrupted state. With checksums turned off the same corruption goes unnoticed (the check is
// what catches it).
TEST(Offload, CorruptedSwapBlockIsDetectedWithTheDefaultSettings) {
  for (bool checksum : {true, false}) {
    SCOPED_TRACE(checksum ? "default (checksums on)" : "checksums off");
    zinf::testing::TempDir nvme;
    EngineSettings s;
    s.stage = 3;
    s.param_home = Tier::kNvme;
    s.optimizer_home = Tier::kNvme;
    s.nvme_paths = {nvme.path()};
    if (!checksum) s.checksum = false;
    auto group = comm::make_local_group(1).value();
    auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
    std::vector<uint64_t> samples = {0, 1};
    Status first_error;
    for (int step = 0; step < 3 && first_error.is_ok(); ++step) {
      // From the second step on, the first read of a swap file returns one flipped byte.
      if (step == 1) {
        ASSERT_TRUE(io::FaultInjector::global().add_spec("read:1:corrupt:swap-").is_ok());
      }
      auto loss = testing::mlp_micro_step(*engine, {}, samples);
      first_error = loss.is_ok() ? engine->step() : loss.status();
    }
    const uint64_t fired = io::FaultInjector::global().fired();
    io::FaultInjector::global().clear();
    EXPECT_EQ(fired, 1u) << "the corruption was applied";
    if (checksum) {
      ASSERT_FALSE(first_error.is_ok());
      EXPECT_EQ(first_error.code(), ErrorCode::kCorrupt) << first_error.to_string();
      for (const char* part : {"checksum mismatch", "at offset", "swap extent", "layer"}) {
        EXPECT_NE(first_error.message().find(part), std::string::npos)
            << part << " in " << first_error.message();
      }
    } else {
      EXPECT_TRUE(first_error.is_ok()) << first_error.to_string();
    }
  }
}

}  // namespace
}  // namespace zinf
