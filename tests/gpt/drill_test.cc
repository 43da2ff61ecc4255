// Drills: faults injected at random points of a whole offloaded 2-rank run. Every run
// either finishes with the parameters of a run without faults, bit for bit, or stops with a clear
// error naming the failure; never a hang, never silently different weights, and never a swap file
// left behind.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "../io/test_dir.h"
#include "zinf/gpt/trainer.h"
#include "zinf/io/fault.h"

namespace zinf::gpt {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

bool empty_dir(const std::string& dir) { return std::filesystem::is_empty(dir); }

TrainOptions options(const std::string& swap, const std::string& out) {
  TrainOptions o;
  o.model = preset("tiny").value();
  o.model_name = "tiny";
  o.batch = 2;
  o.steps = 4;
  o.ranks = 2;
  o.progress = false;
  o.engine.stage = 3;
  o.engine.param_home = Tier::kNvme;
  o.engine.optimizer_home = Tier::kNvme;
  o.engine.nvme_paths = {swap};
  o.engine.device_mem = 4ull << 20;
  o.engine.host_mem = 48ull << 20;  // small: the run keeps going back to the disk
  o.export_path = out;
  return o;
}

class Drill : public ::testing::Test {
 protected:
  void SetUp() override {
    swap_ = dir_.path() + "/swap";
    std::filesystem::create_directories(swap_);
    reference_ = dir_.path() + "/reference.safetensors";
    io::FaultInjector::global().clear();
    auto r = train(options(swap_, reference_));
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    expected_ = read_file(reference_);
    ASSERT_FALSE(expected_.empty());
  }
  void TearDown() override { io::FaultInjector::global().clear(); }

  // Runs with `spec` injected; returns the error (ok when the run finished). A finished run must
  // have exported the reference parameters; either way the swap directory is left empty.
  Status run_with(const std::string& spec) {
    io::FaultInjector::global().clear();
    EXPECT_TRUE(io::FaultInjector::global().add_spec(spec).is_ok()) << spec;
    const std::string out = dir_.path() + "/drill.safetensors";
    std::filesystem::remove(out);
    auto r = train(options(swap_, out));
    io::FaultInjector::global().clear();
    EXPECT_TRUE(empty_dir(swap_)) << spec << ": swap files left behind";
    if (r.is_ok()) {
      EXPECT_EQ(read_file(out), expected_) << spec << ": finished with different parameters";
      return Status::ok();
    }
    return r.status();
  }

  zinf::testing::TempDir dir_;
  std::string swap_, reference_, expected_;
};

// Transient faults (short transfers, EAGAIN) are retried: the run finishes, bit for bit.
TEST_F(Drill, TransientFaultsAnywhereAreRetried) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> at(1, 300);
  for (const char* kind : {"short", "eagain"}) {
    for (int k = 0; k < 4; ++k) {
      const std::string spec = fmt::format("any:{}:{}", at(rng), kind);
      Status s = run_with(spec);
      EXPECT_TRUE(s.is_ok()) << spec << ": " << s.to_string();
    }
  }
}

// Hard faults (EIO, a full disk) stop the run with the error named; or, where the chosen
// submission never comes, the run finishes with the reference parameters.
TEST_F(Drill, HardFaultsAnywhereStopEveryRankWithTheError) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> at(1, 300);
  int stopped = 0;
  for (const char* spec_kind : {"write:{}:eio", "read:{}:eio", "write:{}:enospc"}) {
    for (int k = 0; k < 3; ++k) {
      const std::string spec = fmt::format(fmt::runtime(spec_kind), at(rng));
      Status s = run_with(spec);
      if (s.is_ok()) continue;
      ++stopped;
      const std::string m = s.to_string();
      EXPECT_TRUE(m.find("Input/output error") != std::string::npos ||
                  m.find("No space left") != std::string::npos)
          << spec << ": " << m;
      EXPECT_NE(m.find("rank"), std::string::npos) << spec << ": " << m;
    }
  }
  EXPECT_GT(stopped, 0) << "no fault landed: the drill tested nothing";
}

// A swap block corrupted on its way back is caught by its checksum (on by default), never used.
// (This drill also guards the local backend: a rank woken late from a meeting must not copy from
// a peer's operation that the peer, finding the group broken, has already left; the local
// communicator marks every rank as reading when the meeting completes.)
TEST_F(Drill, CorruptedSwapReadsAreCaught) {
  int caught = 0;
  for (int n : {5, 40, 120}) {
    const std::string spec = fmt::format("read:{}:corrupt", n);
    Status s = run_with(spec);
    if (s.is_ok()) continue;
    ++caught;
    EXPECT_NE(s.to_string().find("checksum mismatch"), std::string::npos)
        << spec << ": " << s.to_string();
  }
  EXPECT_GT(caught, 0);
}

// A disk that cannot even preallocate the swap space: a clear error before training.
TEST_F(Drill, AFullDiskAtStartIsAClearError) {
  Status s = run_with("fallocate:enospc");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.to_string().find("No space left"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace zinf::gpt
