// Device budgets from the floor upward: the engine either refuses a budget up front,
// naming what it needs, or trains in it; every budget from the first it accepts trains, and the
// parameters are bit for bit those of a run with an unbounded budget (the scheduler fetches
// less and fewer reductions stay in flight, which changes no arithmetic).
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>

#include "../io/test_dir.h"
#include "zinf/gpt/trainer.h"

namespace zinf::gpt {
namespace {

struct Case {
  const char* name;
  int ranks, stage;
  Tier params, optimizer;
  DType dtype;
};

constexpr Case kCases[] = {
    {"stage 3, all on NVMe, 1 rank", 1, 3, Tier::kNvme, Tier::kNvme, DType::kF32},
    {"stage 3, all on NVMe, 2 ranks, bf16", 2, 3, Tier::kNvme, Tier::kNvme, DType::kBF16},
    {"stage 3, all on the CPU, 2 ranks", 2, 3, Tier::kHost, Tier::kHost, DType::kF32},
    {"stage 3 on the device, 2 ranks", 2, 3, Tier::kDevice, Tier::kDevice, DType::kF32},
    {"stage 2, optimizer on NVMe, 2 ranks", 2, 2, Tier::kDevice, Tier::kNvme, DType::kF32},
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(BudgetWalk, EveryBudgetFromTheFloorUpTrainsToTheSameParameters) {
  zinf::testing::TempDir dir;
  for (const Case& c : kCases) {
    auto options = [&](uint64_t device_mem, const std::string& out) {
      TrainOptions o;
      o.model = preset("small").value();
      o.model_name = "small";
      o.batch = 2;
      o.steps = 3;
      o.ranks = c.ranks;
      o.progress = false;
      o.engine.stage = c.stage;
      o.engine.dtype = c.dtype;
      o.engine.param_home = c.params;
      o.engine.optimizer_home = c.optimizer;
      o.engine.nvme_paths = {dir.path()};
      o.engine.device_mem = device_mem;
      o.engine.host_mem = 64ull << 20;
      o.export_path = out;
      return o;
    };
    const std::string reference = dir.path() + "/reference.safetensors";
    ASSERT_TRUE(train(options(uint64_t{1} << 30, reference)).is_ok()) << c.name;
    const std::string expected = read_file(reference);
    ASSERT_FALSE(expected.empty());

    int refused = 0, trained = 0;
    for (uint64_t budget = 1ull << 20; budget <= (24ull << 20); budget = budget * 9 / 8) {
      const std::string out = dir.path() + "/walk.safetensors";
      auto r = train(options(budget, out));
      if (!r.is_ok()) {
        // Below the floor: refused before training, with the need named; never above it.
        EXPECT_EQ(trained, 0) << c.name << ": a budget of " << budget
                              << " B failed after a smaller one trained: "
                              << r.status().to_string();
        EXPECT_NE(r.status().message().find("is too small"), std::string::npos)
            << c.name << ", " << budget << " B: " << r.status().to_string();
        ++refused;
        continue;
      }
      ++trained;
      EXPECT_EQ(read_file(out), expected) << c.name << ": parameters differ at " << budget << " B";
    }
    EXPECT_GT(refused, 0) << c.name << ": the walk should start below the floor";
    EXPECT_GT(trained, 3) << c.name;
  }
}

}  // namespace
}  // namespace zinf::gpt
