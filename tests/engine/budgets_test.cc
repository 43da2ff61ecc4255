// The automatic budgets (zinf/engine/budgets.h): hand-computed cases of the rule.
#include "zinf/engine/budgets.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "zinf/engine/engine.h"

namespace zinf {
namespace {

constexpr uint64_t GiB = 1ull << 30, MiB = 1ull << 20;
const MachineMemory kBox{.total_bytes = 24 * GiB, .available_bytes = 23 * GiB};

// The 2b preset at stage 3 with parameters and optimizer on NVMe, one rank, no budget flags:
// device and host together stay within a quarter of MemAvailable.
TEST(Budgets, NvmeOffloadKeepsRamSmall) {
  EngineSettings s;
  s.stage = 3;
  s.param_home = s.optimizer_home = Tier::kNvme;
  const StateSizes z{.largest_unit_elements = 80'000'000,
                     .total_unit_elements = 2'050'000'000,
                     .staging_bytes = 24 * MiB,
                     .nvme = true,
                     .params_offloaded = true};
  const Budgets b = choose_budgets(s, z, kBox, 1);
  EXPECT_EQ(b.device_bytes, 23 * GiB / 8);  // the live window (~10 GB) is more than the share
  EXPECT_EQ(b.host_bytes, 23 * GiB / 8);    // max_in_cpu (1e9 fp32 = 4 GB) is more than the share
  EXPECT_LE(b.device_bytes + b.host_bytes, kBox.available_bytes / 4);
  EXPECT_NE(b.host_reason.find("1/8 of MemAvailable"), std::string::npos) << b.host_reason;
}

// The memory ladder's last rung: 4 local ranks, max_live 2e7, max_in_cpu 0: the device holds the
// live window, the host the staging buffers and the working floor.
TEST(Budgets, LiveWindowAndMaxInCpuBoundTheTiers) {
  EngineSettings s;
  s.stage = 3;
  s.param_home = s.optimizer_home = Tier::kNvme;
  s.max_live_elements = 20'000'000;
  s.param_max_in_cpu = 0;
  const StateSizes z{.largest_unit_elements = 7'100'000,
                     .total_unit_elements = 86'000'000,
                     .staging_bytes = 24 * MiB,
                     .cpu_update_bytes = 2 * 1'775'000 * 4,
                     .optimizer_offloaded = true,
                     .world = 4,
                     .nvme = true,
                     .params_offloaded = true};
  const Budgets b = choose_budgets(s, z, kBox, 4);
  // 1.25 (a unit and its shard) x (the live bound + 4 of the largest unit) in fp32.
  EXPECT_EQ(b.device_bytes, static_cast<uint64_t>(1.25 * (20'000'000 + 4 * 7'100'000) * 4));
  // Staging, the CPU optimizer's two parameter shards and the sub-group floor; no cache.
  EXPECT_EQ(b.host_bytes, 24 * MiB + 2 * 1'775'000 * 4 + kHostWorkingFloor);
  EXPECT_NE(b.device_reason.find("live window"), std::string::npos) << b.device_reason;
}

TEST(Budgets, WithoutOffloadTheDeviceTakesHalfOfWhatIsAvailable) {
  EngineSettings s;
  const StateSizes z{
      .largest_unit_elements = 1000, .total_unit_elements = 10'000, .device_home_bytes = 160'000};
  const Budgets b = choose_budgets(s, z, kBox, 2);
  EXPECT_EQ(b.device_bytes, 23 * GiB / 2 / 2);
  EXPECT_EQ(b.host_bytes, 23 * GiB / 4 / 2);
}

// On a GPU the device budget is the GPU's own free memory (3/4 of it, split between the ranks
// that share the GPU: the model's activations live beside it), not a share of the host's RAM;
// the host budget is unchanged.
TEST(Budgets, OnAGpuTheDeviceTakesTheGpusFreeMemory) {
  EngineSettings s;
  const StateSizes z{
      .largest_unit_elements = 1000, .total_unit_elements = 10'000, .device_home_bytes = 160'000};
  MachineMemory gpu_box = kBox;
  gpu_box.device_free_bytes = 80 * GiB;
  gpu_box.ranks_per_device = 2;
  const Budgets b = choose_budgets(s, z, gpu_box, 4);
  EXPECT_EQ(b.device_bytes, 80 * GiB / 4 * 3 / 2);
  EXPECT_NE(b.device_reason.find("GPU's free memory over the 2 rank(s)"), std::string::npos)
      << b.device_reason;
  EXPECT_EQ(b.host_bytes, 23 * GiB / 4 / 4);
  // State homed on the device beyond that share still gets its room, and the reason says so.
  const StateSizes big{
      .largest_unit_elements = 1000, .total_unit_elements = 10'000, .device_home_bytes = 50 * GiB};
  const Budgets c = choose_budgets(s, big, gpu_box, 4);
  EXPECT_GE(c.device_bytes, 50 * GiB);
  EXPECT_NE(c.device_reason.find("the GPU's free memory"), std::string::npos) << c.device_reason;
}

// State homed in a tier always fits there, with a reason that says it is more than the share.
TEST(Budgets, HomedStateAlwaysFits) {
  EngineSettings s;
  s.optimizer_home = Tier::kHost;
  const StateSizes z{.largest_unit_elements = 1'000'000,
                     .total_unit_elements = 4'000'000'000,
                     .device_home_bytes = 16 * GiB,
                     .host_home_bytes = 48 * GiB};
  const Budgets b = choose_budgets(s, z, kBox, 1);
  // Homed state and one unit's working set (one rank: no shard beside it, no reduction in
  // flight).
  EXPECT_EQ(b.device_bytes, 16 * GiB + 2 * 1'000'000 * 4);
  EXPECT_GE(b.host_bytes, 48 * GiB);
  EXPECT_NE(b.host_reason.find("more than the share"), std::string::npos) << b.host_reason;
  EXPECT_NE(b.device_reason.find("more than the share"), std::string::npos) << b.device_reason;
}

// The scheduler's live bound: what fits beside the homed state and the unit being worked on
// (each gathered element with its share of the shard in flight), never less than one unit.
TEST(Budgets, TheLiveBoundIsWhatFitsBesideTheWorkingSet) {
  const StateSizes z{.largest_unit_elements = 1'000'000, .device_home_bytes = 8 * MiB, .world = 4};
  // Working set: 1.25 x 4 units x 4 bytes = 20 MB; 100 MB - 8 MiB - 20 MB left, 5 bytes each.
  const uint64_t budget = 100'000'000;
  EXPECT_EQ(device_working_bytes(z, DType::kF32), 20'000'000u);
  EXPECT_EQ(live_elements_that_fit(z, DType::kF32, budget), (budget - 8 * MiB - 20'000'000) / 5);
  EXPECT_EQ(live_elements_that_fit(z, DType::kBF16, budget),
            (budget - 8 * MiB - 10'000'000) * 2 / 5);
  EXPECT_EQ(live_elements_that_fit(z, DType::kF32, 10 * MiB), 1'000'000u);  // one unit at least
  // One rank gathers and reduces in place, with no reduction in flight: 2 units x 4 bytes, and 4
  // bytes per live element.
  StateSizes one = z;
  one.world = 1;
  EXPECT_EQ(device_working_bytes(one, DType::kF32), 8'000'000u);
  EXPECT_EQ(live_elements_that_fit(one, DType::kF32, budget), (budget - 8 * MiB - 8'000'000) / 4);
}

// Small budgets keep fewer reductions in flight instead of failing mid-step: each gradient buffer
// in flight (with its reduced shard) is one unit's worth; below one unit's working set, -1.
TEST(Budgets, ReductionsInFlightShrinkWithTheBudget) {
  const StateSizes z{.largest_unit_elements = 1'000'000,
                     .persistent_elements = 200'000,
                     .device_home_bytes = 8 * MiB,
                     .world = 4};
  // 1.25 x 4 bytes per element: persistent 1 MB and 0.8 MB for their gradients, one unit 5 MB;
  // the floor (no reduction in flight) is the homed state, the persistent units and their
  // gradients, the unit gathered and its gradient.
  EXPECT_EQ(device_minimum_bytes(z, DType::kF32, 0), 8 * MiB + 1'800'000 + 10'000'000);
  EXPECT_EQ(device_minimum_bytes(z, DType::kF32, 2), 8 * MiB + 1'800'000 + 20'000'000);
  const uint64_t floor = device_minimum_bytes(z, DType::kF32, 0);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, floor - 1, true), -1);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, floor, true), 0);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, floor + 5'000'000, true), 1);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, floor + 10'000'000, true), 2);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, 1 * GiB, true), 2);
  EXPECT_EQ(reductions_that_fit(z, DType::kF32, 1 * GiB, false), 0);  // without overlap_comm
  // The live bound grows by what fewer reductions leave free.
  EXPECT_EQ(live_elements_that_fit(z, DType::kF32, 100'000'000, 0),
            (100'000'000 - 8 * MiB - 10'000'000) / 5);
  // One rank: the same floor without the shards beside the units, and nothing in flight.
  StateSizes one = z;
  one.world = 1;
  EXPECT_EQ(device_minimum_bytes(one, DType::kF32, 0), 8 * MiB + 1'600'000 + 8'000'000);
  EXPECT_EQ(device_minimum_bytes(one, DType::kF32, 2), 8 * MiB + 1'600'000 + 8'000'000);
  EXPECT_EQ(reductions_that_fit(one, DType::kF32, 1 * GiB, true), 0);
}

TEST(Budgets, ExplicitBudgetsAreKept) {
  EngineSettings s;
  s.device_mem = 64 * MiB;
  s.host_mem = 32 * MiB;
  const Budgets b = choose_budgets(s, StateSizes{.nvme = true}, kBox, 1);
  EXPECT_EQ(b.device_bytes, 64 * MiB);
  EXPECT_EQ(b.host_bytes, 32 * MiB);
}

TEST(Budgets, RanksOnThisMachineComeFromTheLauncher) {
  // The launcher's variables of this process are set aside for the test and restored after.
  const char* names[] = {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                         "SLURM_NTASKS_PER_NODE"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    ::unsetenv(n);
  }
  EXPECT_EQ(ranks_on_this_machine(true, 4), 4);  // local ranks: all in this process
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  EXPECT_EQ(ranks_on_this_machine(false, 8), 3);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);  // torchrun's wins
  EXPECT_EQ(ranks_on_this_machine(false, 8), 2);
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::setenv("LOCAL_WORLD_SIZE", "junk", 1);
  EXPECT_EQ(ranks_on_this_machine(false, 8), 8);  // unknown: every rank, the safe side
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_EQ(ranks_on_this_machine(false, 8), 8);
  for (const auto& [n, v] : saved) ::setenv(n.c_str(), v.c_str(), 1);
}

// Optimizer state alone on NVMe: the host budget holds staging, two parameter tensors and the
// cache; below the floor, the floor wins over the share.
TEST(Budgets, OptimizerOnNvmeAndATinyMachine) {
  EngineSettings s;
  s.stage = 2;
  s.optimizer_home = Tier::kNvme;
  s.param_max_in_cpu = 0;
  const StateSizes z{.largest_unit_elements = 1'000'000,
                     .total_unit_elements = 8'000'000,
                     .device_home_bytes = 32'000'000,
                     .staging_bytes = 24 * MiB,
                     .cpu_update_bytes = 2 * 4'000'000,
                     .optimizer_offloaded = true,
                     .world = 2,
                     .nvme = true};
  Budgets b = choose_budgets(s, z, kBox, 2);
  EXPECT_EQ(b.host_bytes, 24 * MiB + 2 * 4'000'000 + kHostWorkingFloor);
  const MachineMemory tiny{.total_bytes = 256 * MiB, .available_bytes = 64 * MiB};
  b = choose_budgets(s, z, tiny, 2);
  EXPECT_EQ(b.host_bytes, 24 * MiB + 2 * 4'000'000 + kHostWorkingFloor);  // the floor
  EXPECT_EQ(b.device_bytes, 32'000'000 + static_cast<uint64_t>(1.5 * 4 * 1'000'000 * 4));
  EXPECT_NE(b.device_reason.find("more than the share"), std::string::npos) << b.device_reason;
}

TEST(Budgets, MachineMemoryIsRead) {
  auto m = read_machine_memory();
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_GT(m->total_bytes, 0u);
  EXPECT_LE(m->available_bytes, m->total_bytes);
}

}  // namespace
}  // namespace zinf
