// The scheduler in the engine: units all-gathered ahead along the recorded order, kept between
// close uses, bounded by the live budget; optimizer sub-groups; updates overlapped with the
// backward pass. None of it may change a bit of the result.
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <filesystem>

#include "../io/test_dir.h"
#include "mlp.h"
#include "zinf/io/fault.h"

namespace zinf {
namespace {

using testing::MlpShape;
using testing::RunResult;
using testing::same_bits;
using testing::train_local;

EngineSettings stage3() {
  EngineSettings s;
  s.stage = 3;
  s.adam.lr = 0.01f;
  s.gradient_clipping = 0.5f;
  s.param_persistence_threshold = 0;  // the test model's units are below DeepSpeed's 1e5
  return s;
}

// Every unit's full parameters; a unit that cannot be read fails the test and is left out.
std::vector<std::vector<float>> all_parameters(Engine& engine) {
  std::vector<std::vector<float>> params;
  for (size_t u = 0; u < engine.unit_count(); ++u) {
    auto p = engine.full_parameters(u);
    EXPECT_TRUE(p.is_ok()) << "unit " << u << ": " << p.status().to_string();
    if (p.is_ok()) params.push_back(std::move(p).value());
  }
  return params;
}

// stage3() with the parameters and the optimizer state on NVMe in `dir`, in sub-groups of 4096.
EngineSettings stage3_on_nvme(const std::string& dir) {
  EngineSettings s = stage3();
  s.param_home = Tier::kNvme;
  s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {dir};
  s.sub_group_elements = 4096;
  return s;
}

// A one-rank engine over `shape`'s MLP, with the communicator it uses (declared first: it
// outlives the engine). `engine` is null, the failure reported, when it cannot be made.
struct OneRank {
  std::vector<std::unique_ptr<comm::Communicator>> group;
  std::unique_ptr<Engine> engine;
};
OneRank one_rank_engine(const EngineSettings& s, const MlpShape& shape) {
  OneRank r{.group = comm::make_local_group(1).value()};
  auto engine = Engine::create(s, *r.group[0], testing::mlp_units(shape), testing::mlp_init);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  if (engine.is_ok()) r.engine = std::move(engine).value();
  return r;
}

// stage3_on_nvme() with the read-ahead on, 1 MiB staging buffers, two per lane (6.3 MB in all),
// and a host budget of `host_mem`.
EngineSettings small_staging_on_nvme(const std::string& dir, uint64_t host_mem) {
  EngineSettings s = stage3_on_nvme(dir);
  s.staging_bytes = 1 << 20;
  s.staging_buffers = 2;
  s.host_mem = host_mem;
  s.pipeline_read = true;  // (zinf train's default)
  return s;
}

// The MLP of the tests of the state the walk behind step() keeps, leaves on the device or leaves
// for the backward pass: 11 units, 2.4 MB of parameters, 4.8 MB of m and v in 156 groups.
const MlpShape kElevenUnits{.dims = {32, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 8}};

uint64_t padded_elements(const MlpShape& shape, int world, size_t unit) {
  return zero::make_shard_layout(testing::mlp_units(shape)[unit], world, DType::kF32)->numel_padded;
}

// The MLP's step uses units 0, 1, 2 (forward) then 2, 1, 0 (backward).
TEST(Schedule, PrefetchAndReuseFollowTheTraceAndKeepTheBits) {
  const MlpShape shape;
  const int world = 2;
  uint64_t P = 0;
  for (size_t u = 0; u < 3; ++u) P += padded_elements(shape, world, u);

  EngineSettings off = stage3();
  off.prefetch_bucket_elements = 0;
  off.max_reuse_distance = 0;
  RunResult plain = train_local(off, world, 3, 2, shape);
  ASSERT_TRUE(plain.status.is_ok()) << plain.status.to_string();
  EXPECT_EQ(plain.schedule[0].gathers_on_demand, 6u);
  EXPECT_EQ(plain.schedule[0].gathers_ahead, 0u);
  EXPECT_EQ(plain.comm[0].param_gather_elements, 2 * P);

  RunResult first = train_local(stage3(), world, 1, 2, shape);
  ASSERT_TRUE(first.status.is_ok());
  EXPECT_FALSE(first.schedule[0].following) << "the first step records";
  EXPECT_EQ(first.schedule[0].gathers_ahead, 0u);

  // Defaults (DeepSpeed's): everything ahead is gathered ahead, every unit is kept until its
  // backward use. One all-gather per unit per step.
  RunResult sched = train_local(stage3(), world, 3, 2, shape);
  ASSERT_TRUE(sched.status.is_ok()) << sched.status.to_string();
  EXPECT_TRUE(same_bits(plain, sched));
  for (int r = 0; r < world; ++r) {
    const ScheduleReport& rep = sched.schedule[r];
    EXPECT_TRUE(rep.following);
    EXPECT_EQ(rep.departures, 0u);
    EXPECT_EQ(rep.gathers_on_demand, 1u) << "unit 0's first use";
    EXPECT_EQ(rep.gathers_ahead, 2u) << "units 1 and 2, issued at unit 0's use";
    EXPECT_EQ(rep.uses_served_ahead, 2u);
    EXPECT_EQ(rep.uses_served_kept, 3u) << "every backward use";
    EXPECT_EQ(rep.peak_live_elements, P);
    EXPECT_EQ(sched.comm[r].param_gather_elements, P);
  }

  // Reuse only within one unit's distance: unit 2 is used twice in a row (distance 0), unit 1
  // has unit 2 in between, unit 0 has 1, 2, 2, 1.
  EngineSettings near = stage3();
  near.prefetch_bucket_elements = 0;
  near.max_reuse_distance = 2 * padded_elements(shape, world, 2);
  RunResult kept = train_local(near, world, 3, 2, shape);
  ASSERT_TRUE(kept.status.is_ok());
  EXPECT_TRUE(same_bits(plain, kept));
  EXPECT_EQ(kept.schedule[0].uses_served_kept, 2u) << "units 2 and 1";
  EXPECT_EQ(kept.schedule[0].gathers_on_demand, 4u);
}

// One rank with its parameters on NVMe: a use waits for at most one shard ahead still being read,
// and the gathers ahead after it start at later uses once read. When a unit is gathered depends
// on the disk, but each is gathered once, every use is served, and no bit changes.
TEST(Schedule, OneRankGathersAheadOnlyWhatWasReadAndKeepsTheBits) {
  zinf::testing::TempDir nvme;
  const MlpShape shape;
  EngineSettings s = stage3();
  s.param_home = s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  EngineSettings off = s;
  off.prefetch_bucket_elements = 0;
  off.max_reuse_distance = 0;
  const int micro = 2;
  RunResult plain = train_local(off, 1, 4, micro, shape);
  ASSERT_TRUE(plain.status.is_ok()) << plain.status.to_string();
  RunResult sched = train_local(s, 1, 4, micro, shape);
  ASSERT_TRUE(sched.status.is_ok()) << sched.status.to_string();
  EXPECT_TRUE(same_bits(plain, sched));
  const ScheduleReport& rep = sched.schedule[0];
  EXPECT_TRUE(rep.following);
  // The report covers the recorded trace: units 0, 1, 2 forward and 2, 1, 0 backward. Every unit
  // is kept until its backward use (DeepSpeed's reuse distance), so one all-gather per unit.
  EXPECT_EQ(rep.gathers_on_demand + rep.gathers_ahead, 3u);
  EXPECT_EQ(rep.gathers_on_demand + rep.uses_served_ahead + rep.uses_served_kept, 6u);
}

TEST(Schedule, TheLiveBoundLimitsWhatIsGatheredAhead) {
  const MlpShape shape{.dims = {32, 256, 256, 256, 8}};
  const int world = 2;
  const uint64_t big = padded_elements(shape, world, 1);  // units 1 and 2 are the large ones
  EngineSettings s = stage3();
  s.max_reuse_distance = 0;
  s.max_live_elements = big + padded_elements(shape, world, 0);  // never two large ones at once
  RunResult bounded = train_local(s, world, 3, 1, shape);
  ASSERT_TRUE(bounded.status.is_ok()) << bounded.status.to_string();
  for (int r = 0; r < world; ++r) {
    EXPECT_LE(bounded.schedule[r].peak_live_elements, s.max_live_elements);
    EXPECT_GT(bounded.schedule[r].gathers_ahead, 0u);
  }
  EngineSettings off = s;
  off.prefetch_bucket_elements = 0;
  RunResult plain = train_local(off, world, 3, 1, shape);
  ASSERT_TRUE(plain.status.is_ok());
  EXPECT_TRUE(same_bits(plain, bounded));
}

// A step that uses the units in another order (here: an extra forward pass before the update,
// as an evaluation would) is a departure: reported, re-recorded, and the results do not change.
TEST(Schedule, ADepartureFromTheTraceChangesNothing) {
  const MlpShape shape;
  auto extra_forward = [&](Engine& e, int step) {
    if (step != 1) return;
    for (size_t u = 0; u < e.unit_count(); ++u) {
      auto scope = e.gather(u);
      ASSERT_TRUE(scope.is_ok()) << scope.status().to_string();
    }
  };
  EngineSettings off = stage3();
  off.prefetch_bucket_elements = 0;
  off.max_reuse_distance = 0;
  // Step 0 records; step 1 departs (the extra uses) and records them; step 2 ends early against
  // that trace (a departure) and the next step records again; step 3 records; step 4 follows.
  RunResult plain = train_local(off, 2, 5, 2, shape, extra_forward);
  RunResult sched = train_local(stage3(), 2, 5, 2, shape, extra_forward);
  ASSERT_TRUE(plain.status.is_ok() && sched.status.is_ok()) << sched.status.to_string();
  EXPECT_TRUE(same_bits(plain, sched));
  EXPECT_EQ(sched.schedule[0].departures, 2u) << "the extra uses, then the step without them";
  EXPECT_TRUE(sched.schedule[0].following) << "re-recorded and followed again";
  EXPECT_GT(sched.schedule[0].uses_served_ahead, 0u);
}

// sub_group_size cuts the optimizer state into pieces; the global norm is summed in fixed
// blocks, so neither the cut nor the stage changes a bit. With NVMe offload the pieces are the
// unit of traffic.
TEST(Schedule, SubGroupsKeepTheBitsAtEveryStage) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  const int world = 2;
  RunResult reference;
  for (int stage : {0, 1, 2, 3}) {
    for (uint64_t sub_group : {uint64_t{0}, uint64_t{4096}, uint64_t{1'000'000'000}}) {
      for (Tier home : {Tier::kDevice, Tier::kNvme}) {
        if (home == Tier::kNvme && stage == 0) continue;
        EngineSettings s = stage3();
        s.stage = stage;
        s.sub_group_elements = sub_group;
        s.optimizer_home = home;
        s.nvme_paths = {nvme.path()};
        // DeepSpeed's pipeline switches change the timing, never the result.
        s.pipeline_read = sub_group != 4096;
        s.pipeline_write = sub_group == 0;
        RunResult r = train_local(s, world, 3, 2, shape);
        ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
        if (reference.params.empty()) {
          reference = r;
        } else {
          EXPECT_TRUE(same_bits(reference, r))
              << "stage " << stage << " sub_group " << sub_group << " home " << tier_name(home);
        }
        // Unit 1 (65792 elements, 32896 per rank) is cut in 4096-element pieces.
        const size_t groups = r.schedule[0].sub_groups;
        if (sub_group == 4096) {
          EXPECT_GE(groups, (stage == 0 ? 65792u : 32896u) / 4096) << "stage " << stage;
        } else if (sub_group == 0) {
          EXPECT_EQ(groups, 3u);
        } else {
          EXPECT_EQ(groups, 1u) << "everything fits one group of 1e9";
        }
      }
    }
  }
}

// Under a host budget the sub-groups are capped at a third of it, so the optimizer pipeline
// holds at most three groups of state in host memory.
TEST(Schedule, SubGroupsFitTheHostBudget) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {64, 1024, 1024, 1024, 8}};
  EngineSettings s = stage3();
  s.optimizer_home = Tier::kNvme;
  s.param_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  s.staging_bytes = 1 << 20;
  s.staging_buffers = 2;
  s.host_mem = 12 << 20;  // one unit's state per rank is 8.4 MB: it must be cut
  RunResult r = train_local(s, 2, 2, 1, shape);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  EXPECT_GT(r.schedule[0].sub_groups, 4u);
  EXPECT_LE(r.memory[0].tiers[static_cast<int>(Tier::kHost)].peak, s.host_mem);
  EngineSettings plain = stage3();
  RunResult ref = train_local(plain, 2, 2, 1, shape);
  ASSERT_TRUE(ref.status.is_ok());
  EXPECT_TRUE(same_bits(ref, r));
}

// overlap_optimizer: without clipping, each unit's update starts once its gradients are final,
// while the backward pass goes on; the results are the same bits.
TEST(Schedule, OverlappedUpdatesKeepTheBits) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  for (int stage : {0, 1, 2, 3}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (Tier home : {Tier::kDevice, Tier::kNvme}) {
        if (home == Tier::kNvme && stage == 0) continue;
        EngineSettings s = stage3();
        s.stage = stage;
        s.dtype = dt;
        s.gradient_clipping = 0;
        s.gradient_accumulation_steps = 2;
        s.optimizer_home = home;
        s.param_home = stage == 3 ? home : Tier::kDevice;
        s.nvme_paths = {nvme.path()};
        s.sub_group_elements = 8192;
        RunResult plain = train_local(s, 2, 4, 1, shape);
        s.overlap_optimizer = true;
        RunResult early = train_local(s, 2, 4, 1, shape);
        ASSERT_TRUE(plain.status.is_ok() && early.status.is_ok()) << early.status.to_string();
        EXPECT_TRUE(same_bits(plain, early))
            << "stage " << stage << " " << dtype_name(dt) << " " << tier_name(home);
        ASSERT_EQ(early.info.size(), 4u);
        EXPECT_EQ(early.info[0].units_updated_early, 0u) << "the first step records";
        EXPECT_EQ(early.info[3].units_updated_early, 3u) << "every unit, from the second step";
        EXPECT_EQ(plain.info[3].units_updated_early, 0u);
      }
    }
  }
}

TEST(Schedule, OverlapWaitsForClippingAndFp16) {
  for (bool fp16 : {false, true}) {
    EngineSettings s = stage3();
    s.overlap_optimizer = true;
    s.gradient_clipping = fp16 ? 0 : 0.5f;
    s.dtype = fp16 ? DType::kF16 : DType::kF32;
    RunResult r = train_local(s, 2, 3, 2);
    ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
    EXPECT_EQ(r.info.back().units_updated_early, 0u) << "the update needs every gradient first";
  }
}

// With overlapped updates, using a unit again after its update started would read updated
// parameters in the same step: that is an error naming the unit, not a silent change.
TEST(Schedule, UsingAUnitAfterItsOverlappedUpdateIsAnError) {
  EngineSettings s = stage3();
  s.gradient_clipping = 0;
  s.overlap_optimizer = true;
  auto group = comm::make_local_group(1).value();
  auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
  const std::vector<uint64_t> samples = {0, 1};
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(testing::mlp_micro_step(*engine, {}, samples).is_ok());
    ASSERT_TRUE(engine->step().is_ok());
  }
  ASSERT_TRUE(testing::mlp_micro_step(*engine, {}, samples).is_ok());
  auto again = engine->gather(0);
  ASSERT_FALSE(again.is_ok());
  EXPECT_NE(again.status().message().find("layer0"), std::string::npos) << again.status().message();
  EXPECT_NE(again.status().message().find("after its optimizer update"), std::string::npos);
  EXPECT_TRUE(engine->step().is_ok()) << "the step itself completes";
}

// A read error half-way through the optimizer walk: step() fails naming what it was reading, the
// engine refuses to go on until step() is called again, and that call finishes the update
// without repeating the pieces already done: the run ends on the same bits as one without the
// fault. (The walk inside step(): update_behind off; the walk behind step() is tested below.)
TEST(Schedule, AStepThatFailsHalfWayIsFinishedByTheNextStep) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  EngineSettings s = stage3();
  s.gradient_clipping = 0;
  s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  s.sub_group_elements = 4096;
  s.update_behind = false;
  RunResult clean = train_local(s, 1, 4, 2, shape);
  ASSERT_TRUE(clean.status.is_ok()) << clean.status.to_string();

  auto group = comm::make_local_group(1).value();
  auto engine = Engine::create(s, *group[0], testing::mlp_units(shape), testing::mlp_init).value();
  const std::vector<uint64_t> samples = {0, 1};
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(testing::mlp_micro_step(*engine, shape, samples).is_ok());
    if (step != 2) {
      ASSERT_TRUE(engine->step().is_ok());
      continue;
    }
    io::FaultInjector::global().add({.op = io::IoOp::kRead, .nth = 20, .and_after = true});
    Status failed = engine->step();
    io::FaultInjector::global().clear();
    ASSERT_FALSE(failed.is_ok());
    EXPECT_NE(failed.message().find("swap-"), std::string::npos) << failed.message();
    auto refused = engine->gather(0);
    ASSERT_FALSE(refused.is_ok()) << "some pieces were updated: the step must be finished first";
    EXPECT_NE(refused.status().message().find("call step() again"), std::string::npos)
        << refused.status().message();
    ASSERT_TRUE(engine->step().is_ok());
  }
  for (size_t u = 0; u < engine->unit_count(); ++u) {
    auto p = engine->full_parameters(u);
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(std::memcmp(p->data(), clean.params[u].data(), p->size() * 4), 0) << "unit " << u;
  }
}

// The update behind step() (update_behind, on by default with one rank, stage 3 and the
// optimizer offloaded): step() returns before the update has ended (its entry in update_ends()
// comes when it is waited for), a learning rate set right after step() applies to the next step
// only, and the parameters are bit for bit those of the update inside step(), with clipping on
// and with a host budget too small to read the walk ahead whole.
TEST(Schedule, TheUpdateBehindStepKeepsTheBits) {
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  // The staging (6 MiB) and 640 KiB of the 1.2 MB of state: the walk cannot be held whole. With
  // 11.5 MB and the reads pipelined, the state of some groups is kept for the next walk.
  for (const auto& [host_mem, pipeline_read] :
       {std::pair{uint64_t{6 << 20} + (640 << 10), false}, std::pair{uint64_t{11'500'000}, true}}) {
    SCOPED_TRACE(host_mem);
    auto run = [&](bool behind, bool* returned_early) -> std::vector<std::vector<float>> {
      zinf::testing::TempDir nvme;
      EngineSettings s = stage3_on_nvme(nvme.path());  // clipping at 0.5
      s.staging_bytes = 1 << 20;
      s.staging_buffers = 2;
      s.host_mem = host_mem;
      s.pipeline_read = pipeline_read;
      s.update_behind = behind;
      auto group = comm::make_local_group(1).value();
      auto engine = Engine::create(s, *group[0], testing::mlp_units(shape), testing::mlp_init);
      EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
      if (!engine.is_ok()) return {};
      const std::vector<uint64_t> samples = {0, 1, 2};
      for (int step = 0; step < 4; ++step) {
        EXPECT_TRUE(testing::mlp_micro_step(**engine, shape, samples).is_ok());
        const uint64_t ends = (*engine)->update_ends().size();
        EXPECT_TRUE((*engine)->step().is_ok());
        if ((*engine)->update_ends().size() == ends) *returned_early = true;
        EXPECT_TRUE((*engine)->set_lr(0.01f / static_cast<float>(step + 2)).is_ok());
      }
      EXPECT_TRUE((*engine)->wait_for_update().is_ok());
      EXPECT_EQ((*engine)->update_ends().size(), 4u) << "one entry per step() once waited for";
      return all_parameters(**engine);
    };
    bool early_inside = false, early_behind = false;
    const auto inside = run(false, &early_inside);
    const auto behind = run(true, &early_behind);
    EXPECT_FALSE(early_inside) << "without update_behind, step() returns after its update";
    EXPECT_TRUE(early_behind) << "with update_behind, step() returns before its update has ended";
    ASSERT_EQ(inside.size(), 3u);
    EXPECT_TRUE(same_bits(behind, inside));
  }
}

// With the optimizer state on NVMe and the update behind step(), the backward pass reads the
// walk's first groups ahead from its start, before their units' gradients exist. Their gradient
// accumulators are then zero (acc_zero) and the pass overwrites them: reading their home's old
// bytes was a wasted read (4 bytes per parameter beside m and v's 8, every step). Here the host
// budget lets the backward pass read 10 of the walk's 20 groups ahead, with no room to keep state
// from one walk to the next: a step reads m and v once (partly during the pass, the rest in the
// walk) and writes them once, and reads nothing else (the shards stay in memory). The device
// budget holds one unit at a time: with room for all three the shards would stay on the device
// between passes, and their host room would keep every group's state (no reads at all).
TEST(Schedule, TheReadAheadReadsNoAccumulatorThePassWillOverwrite) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  // Clipping at 0.5: the update waits for the norm. Beside the staging: 10 of the 20 groups
  // ahead, no state kept.
  EngineSettings s = small_staging_on_nvme(nvme.path(), 10'000'000);
  s.device_mem = 768 << 10;  // the working set of the largest unit (2 x 263 KB) and 260 KB
  auto group = comm::make_local_group(1).value();
  auto engine = Engine::create(s, *group[0], testing::mlp_units(shape), testing::mlp_init).value();
  const std::vector<uint64_t> samples = {0, 1};
  for (int step = 0; step < 5; ++step) {
    const StoreStats start = engine->store_stats();
    ASSERT_TRUE(testing::mlp_micro_step(*engine, shape, samples).is_ok());
    ASSERT_TRUE(engine->step().is_ok());
    ASSERT_TRUE(engine->wait_for_update().is_ok());
    const StoreStats end = engine->store_stats();
    if (step < 2) continue;  // the trace is recorded, then followed
    // (Reading the accumulators ahead as well, the steps read 667648 bytes here.)
    const uint64_t read = end.bytes_nvme_read - start.bytes_nvme_read;
    const uint64_t written = end.bytes_nvme_written - start.bytes_nvme_written;
    EXPECT_GT(written, 0u) << "step " << step;
    EXPECT_EQ(read, written) << "step " << step << ": m and v once each way, nothing else";
  }
}

// The shards the walk behind step() keeps for the next forward pass (the host budget has room
// beyond the accumulators) stay in memory unwritten, and so does the optimizer state it keeps for
// the next walk (the room beyond those shards): with everything fitting, a step after the first
// two moves nothing to or from NVMe (writing each kept shard back would cost 4 bytes per parameter
// every step; writing and reading back m and v, 16), and ends on the bits of the update inside
// step().
TEST(Schedule, ShardsKeptForTheNextPassAreNotWrittenBack) {
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  auto run = [&](bool behind, std::vector<uint64_t>* written, std::vector<uint64_t>* read,
                 uint64_t* param_bytes) {
    zinf::testing::TempDir nvme;
    EngineSettings s = stage3_on_nvme(nvme.path());  // clipping at 0.5
    s.host_mem = 64 << 20;                           // every shard, its state and accumulator fit
    s.pipeline_read = true;
    s.update_behind = behind;
    OneRank one = one_rank_engine(s, shape);
    if (!one.engine) return std::vector<std::vector<float>>{};
    Engine& engine = *one.engine;
    *param_bytes = 0;
    for (size_t u = 0; u < engine.unit_count(); ++u) {
      *param_bytes += padded_elements(shape, 1, u) * 4;
    }
    const std::vector<uint64_t> samples = {0, 1};
    uint64_t w0 = 0, r0 = 0;
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(testing::mlp_micro_step(engine, shape, samples).is_ok());
      EXPECT_TRUE(engine.step().is_ok());
      EXPECT_TRUE(engine.wait_for_update().is_ok());
      const StoreStats st = engine.store_stats();
      written->push_back(st.bytes_nvme_written - w0);
      read->push_back(st.bytes_nvme_read - r0);
      w0 = st.bytes_nvme_written;
      r0 = st.bytes_nvme_read;
    }
    return all_parameters(engine);
  };
  std::vector<uint64_t> w_in, r_in, w_behind, r_behind;
  uint64_t param_bytes = 0;
  const auto inside = run(false, &w_in, &r_in, &param_bytes);
  const auto behind = run(true, &w_behind, &r_behind, &param_bytes);
  ASSERT_EQ(w_behind.size(), 5u);
  ASSERT_EQ(w_in.size(), 5u);
  for (int step = 2; step < 5; ++step) {
    // Inside step() every updated shard and its state are written back (and read again);
    // behind it, nothing moves.
    EXPECT_GT(w_in[step], param_bytes) << "step " << step;
    EXPECT_GT(r_in[step], param_bytes) << "step " << step;
    EXPECT_EQ(w_behind[step], 0u) << "step " << step;
    EXPECT_EQ(r_behind[step], 0u) << "step " << step;
  }
  ASSERT_EQ(inside.size(), 3u);
  EXPECT_TRUE(same_bits(behind, inside));
}

// With room on the device for every unit at once (the scheduler's live bound), the walk behind
// step() leaves each unit's shard on the device between passes and takes it back from there; its
// host copy, clean once the pass has gathered it, gives its room to the optimizer state the walk
// keeps for the next walk. Here (11 units, 4.8 MB of m and v, a 14.5 MB host budget of which 6.3
// MB is staging) that room keeps every group's state: a step after the first two moves nothing
// to or from NVMe. With the device holding one unit at a time the shards take that room, and
// steps move m and v of the groups that do not fit. Both end on the bits of the update inside
// step().
TEST(Schedule, ShardsLeftOnTheDeviceGiveTheirHostRoomToTheState) {
  const MlpShape& shape = kElevenUnits;
  auto run = [&](bool behind, uint64_t device_mem, std::vector<uint64_t>* moved) {
    zinf::testing::TempDir nvme;
    EngineSettings s = small_staging_on_nvme(nvme.path(), 14'500'000);  // clipping at 0.5
    s.device_mem = device_mem;  // 0: automatic (every unit fits)
    s.update_behind = behind;
    OneRank one = one_rank_engine(s, shape);
    if (!one.engine) return std::vector<std::vector<float>>{};
    Engine& engine = *one.engine;
    const std::vector<uint64_t> samples = {0, 1};
    uint64_t before = 0;
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(testing::mlp_micro_step(engine, shape, samples).is_ok());
      EXPECT_TRUE(engine.step().is_ok());
      EXPECT_TRUE(engine.wait_for_update().is_ok());
      const StoreStats st = engine.store_stats();
      moved->push_back(st.bytes_nvme_read + st.bytes_nvme_written - before);
      before = st.bytes_nvme_read + st.bytes_nvme_written;
    }
    return all_parameters(engine);
  };
  std::vector<uint64_t> inside_moved, on_device, one_unit;
  const auto inside = run(false, 0, &inside_moved);
  const auto left = run(true, 0, &on_device);
  // The working set of the largest unit (2 x 263 KB) and 260 KB: one unit live at a time.
  const auto taken = run(true, 768 << 10, &one_unit);
  ASSERT_EQ(on_device.size(), 5u);
  ASSERT_EQ(one_unit.size(), 5u);
  for (int step = 2; step < 5; ++step) {
    EXPECT_EQ(on_device[step], 0u) << "step " << step;
    EXPECT_GT(one_unit[step], 0u) << "step " << step;
  }
  ASSERT_EQ(inside.size(), shape.dims.size() - 1);
  EXPECT_TRUE(same_bits(left, inside));
  EXPECT_TRUE(same_bits(taken, inside));
}

// Updates fused into the backward pass (overlap_optimizer) with room on the device for every
// unit: each update refreshes the unit's device copy from the host's, and the next forward pass
// uses it, so the shards never cross the disk; the state of the pass's last updates is written
// once step() has committed (under the next forward pass) and stays in memory, clean, for the
// next pass. Here (the 11-unit MLP, 4.8 MB of m and v, a 14.5 MB host budget of which 6.3 MB is
// staging) all of it stays: a step after the first two reads nothing and writes m and v once (no
// update writes its shard, and no pass reads a shard or state back). With the device holding one
// unit at a time the shards cross the disk. Both end on the bits of the plain step.
TEST(Schedule, UpdatesFusedIntoTheBackwardPassLeaveTheShardsOnTheDevice) {
  const MlpShape& shape = kElevenUnits;
  uint64_t param_bytes = 0;
  for (size_t u = 0; u + 1 < shape.dims.size(); ++u)
    param_bytes += padded_elements(shape, 1, u) * 4;
  struct Moved {
    std::vector<uint64_t> read, written;
  };
  auto run = [&](bool fused, uint64_t device_mem, Moved* moved) {
    zinf::testing::TempDir nvme;
    EngineSettings s = small_staging_on_nvme(nvme.path(), 14'500'000);
    s.gradient_clipping = 0;
    s.overlap_optimizer = fused;
    s.device_mem = device_mem;  // 0: automatic (every unit fits)
    OneRank one = one_rank_engine(s, shape);
    if (!one.engine) return std::vector<std::vector<float>>{};
    Engine& engine = *one.engine;
    const std::vector<uint64_t> samples = {0, 1};
    uint64_t r0 = 0, w0 = 0;
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(testing::mlp_micro_step(engine, shape, samples).is_ok());
      EXPECT_TRUE(engine.step().is_ok());
      if (fused && step >= 2) {
        EXPECT_EQ(engine.last_step().units_updated_early, shape.dims.size() - 1) << step;
      }
      EXPECT_TRUE(engine.wait_for_update().is_ok());
      const StoreStats st = engine.store_stats();
      moved->read.push_back(st.bytes_nvme_read - r0);
      moved->written.push_back(st.bytes_nvme_written - w0);
      r0 = st.bytes_nvme_read;
      w0 = st.bytes_nvme_written;
    }
    return all_parameters(engine);
  };
  Moved plain_moved, on_device, one_unit;
  const auto plain = run(false, 0, &plain_moved);
  const auto left = run(true, 0, &on_device);
  // The working set of the largest unit (2 x 263 KB) and 260 KB: one unit live at a time.
  const auto taken = run(true, 768 << 10, &one_unit);
  ASSERT_EQ(on_device.read.size(), 5u);
  ASSERT_EQ(one_unit.read.size(), 5u);
  for (int step = 2; step < 5; ++step) {
    EXPECT_EQ(on_device.read[step], 0u) << "step " << step;
    EXPECT_LT(on_device.written[step], 3 * param_bytes) << "step " << step;  // m and v, no shard
    EXPECT_GE(one_unit.read[step], param_bytes) << "step " << step;
  }
  ASSERT_EQ(plain.size(), shape.dims.size() - 1);
  EXPECT_TRUE(same_bits(left, plain));
  EXPECT_TRUE(same_bits(taken, plain));
}

// The walk behind step() runs under the next forward pass; the backward pass after it leaves the
// disk idle. So the state of the walk's last groups, past those kept for the next walk, stays
// dirty in the room the spent accumulators leave, and is written during that backward pass (the
// first final gradient starts it). Here (the 11-unit MLP, 156 groups, an 11 MB host budget: 55
// groups kept, 77 left for the pass) a step writes part of m and v while the walk runs and part
// between the walk's end and the next step(), and the run ends on the bits of the update inside
// step(). (The test waits for each walk before the next pass, whose gathers would otherwise make
// the updated shards clean as the walk goes: their dirty host copies then take room the walk meant
// for that state, so most of it is still written during the walk, to make room.)
TEST(Schedule, TheWalksLastStateIsWrittenDuringTheBackwardPass) {
  const MlpShape& shape = kElevenUnits;
  auto run = [&](bool behind, std::vector<uint64_t>* in_walk, std::vector<uint64_t>* in_pass) {
    zinf::testing::TempDir nvme;
    EngineSettings s = small_staging_on_nvme(nvme.path(), 11'000'000);  // clipping at 0.5
    s.update_behind = behind;
    OneRank one = one_rank_engine(s, shape);
    if (!one.engine) return std::vector<std::vector<float>>{};
    Engine& engine = *one.engine;
    const std::vector<uint64_t> samples = {0, 1};
    uint64_t walk_end = 0;
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(testing::mlp_micro_step(engine, shape, samples).is_ok());
      EXPECT_TRUE(engine.step().is_ok());  // waits for the last walk's write-backs
      const uint64_t step_end = engine.store_stats().bytes_nvme_written;
      EXPECT_TRUE(engine.wait_for_update().is_ok());
      const uint64_t now = engine.store_stats().bytes_nvme_written;
      in_pass->push_back(step_end - walk_end);  // the pass since the last walk ended
      in_walk->push_back(now - step_end);
      walk_end = now;
    }
    return all_parameters(engine);
  };
  std::vector<uint64_t> walk_inside, pass_inside, in_walk, in_pass;
  const auto inside = run(false, &walk_inside, &pass_inside);
  const auto behind = run(true, &in_walk, &in_pass);
  ASSERT_EQ(in_walk.size(), 5u);
  for (int step = 2; step < 5; ++step) {
    EXPECT_GT(in_walk[step], 0u) << "step " << step;
    EXPECT_GT(in_pass[step], 0u) << "step " << step;
  }
  ASSERT_EQ(inside.size(), shape.dims.size() - 1);
  EXPECT_TRUE(same_bits(behind, inside));
}

// A write error in the write-behind: behind step(), the backward pass's (the test above's
// settings); fused into the backward pass (overlap_optimizer, no clipping: the settings of
// UpdatesFusedIntoTheBackwardPassLeaveTheShardsOnTheDevice), the one step() starts once
// committed. The run goes on, the next step() reports the failure naming the tensor
// and the swap file, and the copy stays valid in memory, dirty: the run ends on the bits of a run
// without the fault.
TEST(Schedule, AFailedWriteBehindIsReportedByTheNextStepAndLosesNothing) {
  const MlpShape& shape = kElevenUnits;
  auto run = [&](bool fused, bool fault) {
    zinf::testing::TempDir nvme;
    // Fused, a budget that leaves every group's writes behind (the test above's).
    EngineSettings s = small_staging_on_nvme(nvme.path(), fused ? 14'500'000 : 11'000'000);
    if (fused) {
      s.gradient_clipping = 0;
      s.overlap_optimizer = true;
    }
    OneRank one = one_rank_engine(s, shape);
    if (!one.engine) return std::vector<std::vector<float>>{};
    Engine& engine = *one.engine;
    const std::vector<uint64_t> samples = {0, 1};
    auto inject = [] {
      io::FaultInjector::global().add(
          {.op = io::IoOp::kWrite, .nth = 1, .kind = io::FaultKind::kEio});
    };
    int failed = 0;
    for (int step = 0; step < 5; ++step) {
      // Behind step(), the pass's write-behind is the first write from its start on; fused, the
      // first from the end of the first pass that follows the recorded order (its updates left
      // every write behind, and step() starts them).
      if (fault && !fused && step == 3) inject();
      EXPECT_TRUE(testing::mlp_micro_step(engine, shape, samples).is_ok()) << "step " << step;
      if (fault && fused && step == 1) inject();
      if (!fused) io::FaultInjector::global().clear();
      Status st = engine.step();
      if (!st.is_ok()) {
        ++failed;
        EXPECT_EQ(step, fused ? 2 : 3) << st.to_string();
        EXPECT_NE(st.message().find("writing tensor layer"), std::string::npos) << st.message();
        EXPECT_NE(st.message().find("swap-"), std::string::npos) << st.message();
      }
      if (step == 2) io::FaultInjector::global().clear();
      EXPECT_TRUE(engine.wait_for_update().is_ok()) << "step " << step;
    }
    EXPECT_EQ(failed, fault ? 1 : 0) << (fused ? "fused" : "behind");
    return all_parameters(engine);
  };
  for (bool fused : {false, true}) {
    const auto clean = run(fused, false);
    const auto faulted = run(fused, true);
    ASSERT_EQ(clean.size(), shape.dims.size() - 1);
    EXPECT_TRUE(same_bits(faulted, clean)) << (fused ? "fused" : "behind");
  }
}

// A read error in the update behind step(): step() has returned, so the failure comes with the
// next call that needs the update: a gather of a unit the walk did not reach (the first read
// fails) or wait_for_update() (the 20th). It names the swap file; the engine refuses to go on
// until step() is called again, and that call finishes the update: the run ends on the bits of
// one without the fault.
TEST(Schedule, AFailedUpdateBehindStepIsFinishedByTheNextStep) {
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  EngineSettings s = stage3();
  s.gradient_clipping = 0;
  s.optimizer_home = Tier::kNvme;
  s.sub_group_elements = 4096;
  s.pipeline_read = false;  // every read of the walk after step() has returned
  for (const bool met_by_gather : {true, false}) {
    SCOPED_TRACE(met_by_gather ? "met by a gather" : "met by wait_for_update");
    zinf::testing::TempDir nvme;
    s.nvme_paths = {nvme.path()};
    RunResult clean = train_local(s, 1, 4, 2, shape);
    ASSERT_TRUE(clean.status.is_ok()) << clean.status.to_string();
    auto group = comm::make_local_group(1).value();
    auto engine =
        Engine::create(s, *group[0], testing::mlp_units(shape), testing::mlp_init).value();
    const std::vector<uint64_t> samples = {0, 1};
    for (int step = 0; step < 4; ++step) {
      ASSERT_TRUE(testing::mlp_micro_step(*engine, shape, samples).is_ok());
      if (step != 2) {
        ASSERT_TRUE(engine->step().is_ok());
        continue;
      }
      io::FaultInjector::global().add(
          {.op = io::IoOp::kRead, .nth = met_by_gather ? 1u : 20u, .and_after = true});
      ASSERT_TRUE(engine->step().is_ok()) << "the update runs behind step()";
      Status failed;
      if (met_by_gather) {
        auto g = engine->gather(0);
        failed = g.is_ok() ? Status() : g.status();
      } else {
        failed = engine->wait_for_update();
      }
      io::FaultInjector::global().clear();
      ASSERT_FALSE(failed.is_ok());
      EXPECT_NE(failed.message().find("swap-"), std::string::npos) << failed.message();
      if (met_by_gather) {
        EXPECT_NE(failed.message().find("did not reach unit"), std::string::npos)
            << failed.message();
      }
      auto refused = engine->gather(0);
      ASSERT_FALSE(refused.is_ok()) << "the update is incomplete: step() must finish it first";
      EXPECT_NE(refused.status().message().find("call step() again"), std::string::npos)
          << refused.status().message();
      ASSERT_TRUE(engine->step().is_ok());
    }
    ASSERT_TRUE(engine->wait_for_update().is_ok());
    for (size_t u = 0; u < engine->unit_count(); ++u) {
      auto p = engine->full_parameters(u);
      ASSERT_TRUE(p.is_ok());
      EXPECT_EQ(std::memcmp(p->data(), clean.params[u].data(), p->size() * 4), 0) << "unit " << u;
    }
  }
}

// An engine destroyed in the middle of a step, with all-gathers issued ahead still in flight,
// waits for them before freeing their buffers (and does not hang).
TEST(Schedule, DestroyingTheEngineMidStepWaitsForGathersAhead) {
  auto group = comm::make_local_group(2).value();
  std::vector<std::thread> ranks;
  std::vector<Status> status(2);
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto engine = Engine::create(stage3(), *group[r], testing::mlp_units({}), testing::mlp_init);
      if (!engine.is_ok()) {
        status[r] = engine.status();
        return;
      }
      const std::vector<uint64_t> samples = {static_cast<uint64_t>(r)};
      for (int step = 0; step < 2; ++step) {
        if (!testing::mlp_micro_step(**engine, {}, samples).is_ok() || !(*engine)->step().is_ok()) {
          status[r] = make_error(ErrorCode::kInternal, "training failed");
          return;
        }
      }
      auto scope = (*engine)->gather(0);  // issues the all-gathers of units 1 and 2 ahead
      if (!scope.is_ok()) status[r] = scope.status();
    });  // the scope, then the engine, go out of scope here
  }
  for (auto& t : ranks) t.join();
  EXPECT_TRUE(status[0].is_ok()) << status[0].to_string();
  EXPECT_TRUE(status[1].is_ok()) << status[1].to_string();
}

// A read error on one rank only, half-way through its optimizer walk: step() fails on every rank
// (no rank is left waiting in a collective the others skipped), every rank refuses to go on, and
// the next step() on every rank finishes the update: the run ends on the bits of a clean run.
TEST(Schedule, AFailureOnOneRankFailsTheStepEverywhereAndTheRetryFinishesIt) {
  zinf::testing::TempDir nvme;
  const MlpShape shape{.dims = {32, 256, 256, 8}};
  const int world = 2;
  EngineSettings s = stage3();  // with clipping: the norm exchange is part of the protocol
  s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  s.sub_group_elements = 4096;
  RunResult clean = train_local(s, world, 4, 1, shape);
  ASSERT_TRUE(clean.status.is_ok()) << clean.status.to_string();

  auto group = comm::make_local_group(world).value();
  std::barrier sync(world);
  std::vector<std::string> errors(world), refusals(world), problems(world);
  std::vector<std::vector<std::vector<float>>> params(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      EngineSettings mine = s;  // each rank swaps into its own directory: the fault hits rank 0
      mine.nvme_paths = {nvme.path() + "/rank" + std::to_string(r)};
      std::filesystem::create_directories(mine.nvme_paths[0]);
      auto engine = Engine::create(mine, *group[r], testing::mlp_units(shape), testing::mlp_init);
      if (!engine.is_ok()) {
        problems[r] = engine.status().to_string();
        return;
      }
      for (int step = 0; step < 4; ++step) {
        const std::vector<uint64_t> samples = {static_cast<uint64_t>(r)};
        if (!testing::mlp_micro_step(**engine, shape, samples).is_ok()) {
          problems[r] = "micro-step failed";
          return;
        }
        if (step == 2) {
          sync.arrive_and_wait();
          if (r == 0) {
            io::FaultInjector::global().add(
                {.op = io::IoOp::kRead, .nth = 10, .and_after = true, .path_contains = "/rank0/"});
          }
          sync.arrive_and_wait();
          Status failed = (*engine)->step();
          sync.arrive_and_wait();
          if (r == 0) io::FaultInjector::global().clear();
          sync.arrive_and_wait();
          errors[r] = failed.is_ok() ? "" : failed.message();
          auto refused = (*engine)->gather(0);
          refusals[r] = refused.is_ok() ? "" : refused.status().message();
        }
        Status st = (*engine)->step();
        if (!st.is_ok()) {
          problems[r] = st.to_string();
          return;
        }
      }
      for (size_t u = 0; u < (*engine)->unit_count(); ++u) {
        auto p = (*engine)->full_parameters(u);
        if (!p.is_ok()) {
          problems[r] = p.status().to_string();
          return;
        }
        params[r].push_back(std::move(p).value());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(problems[r], "") << "rank " << r;
    EXPECT_NE(refusals[r].find("call step() again"), std::string::npos) << "rank " << r;
  }
  EXPECT_NE(errors[0].find("/rank0/"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("failed on 1 other rank"), std::string::npos) << errors[1];
  ASSERT_EQ(params[0].size(), clean.params.size());
  for (size_t u = 0; u < clean.params.size(); ++u) {
    EXPECT_EQ(std::memcmp(params[0][u].data(), clean.params[u].data(), clean.params[u].size() * 4),
              0)
        << "unit " << u;
  }
}

}  // namespace
}  // namespace zinf
