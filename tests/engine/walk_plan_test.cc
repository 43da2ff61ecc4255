// The optimizer's pure planners: which update mode a configuration gets (UpdatePolicy), the host
// room each mode plans with (plan_host_room), and the walk's order over the sub-groups
// (WalkPlan). The engine's equivalence tests run these through whole steps; here each rule is
// checked alone, with the numbers worked out by hand.
#include "walk_plan.h"

#include <gtest/gtest.h>

#include <vector>

#include "update_policy.h"

namespace zinf::engine_detail {
namespace {

EngineSettings offloaded_stage3() {
  EngineSettings s;
  s.stage = 3;
  s.param_home = Tier::kNvme;
  s.optimizer_home = Tier::kNvme;
  return s;
}

TEST(UpdatePolicy, FusedOnlyWithoutClippingAndFp16) {
  EngineSettings s = offloaded_stage3();
  const StagePolicy stage = StagePolicy::for_stage(3);
  s.overlap_optimizer = true;
  s.gradient_clipping = 0;
  s.dtype = DType::kBF16;
  UpdatePolicy p = UpdatePolicy::decide(s, stage, 1, true);
  EXPECT_TRUE(p.fused);
  EXPECT_FALSE(p.behind);
  EXPECT_FALSE(p.checks_nonfinite());
  EXPECT_FALSE(p.takes_norm(s));
  EXPECT_TRUE(p.params_stay_on_device);

  s.gradient_clipping = 1.0;
  p = UpdatePolicy::decide(s, stage, 1, true);
  EXPECT_FALSE(p.fused);
  EXPECT_TRUE(p.checks_nonfinite());
  EXPECT_TRUE(p.takes_norm(s));

  s.gradient_clipping = 0;
  s.dtype = DType::kF16;  // the overflow check needs every gradient first
  EXPECT_FALSE(UpdatePolicy::decide(s, stage, 1, true).fused);
  EXPECT_FALSE(UpdatePolicy::fusable(s));
}

TEST(UpdatePolicy, BehindNeedsOneRankStage3AndTheOptimizerOffloaded) {
  EngineSettings s = offloaded_stage3();
  s.update_behind = true;
  s.gradient_clipping = 1.0;
  EXPECT_TRUE(UpdatePolicy::decide(s, StagePolicy::for_stage(3), 1, false).behind);
  EXPECT_FALSE(UpdatePolicy::decide(s, StagePolicy::for_stage(3), 2, false).behind);
  EXPECT_FALSE(UpdatePolicy::decide(s, StagePolicy::for_stage(2), 1, false).behind);
  s.optimizer_home = Tier::kDevice;
  EXPECT_FALSE(UpdatePolicy::decide(s, StagePolicy::for_stage(3), 1, false).behind);
  s.optimizer_home = Tier::kHost;
  s.update_behind = false;
  EXPECT_FALSE(UpdatePolicy::decide(s, StagePolicy::for_stage(3), 1, false).behind);
}

TEST(UpdatePolicy, ShardsStayOnTheDeviceOnlyWhenAllFitAndTheyAreHomedOnNvme) {
  EngineSettings s = offloaded_stage3();
  s.update_behind = true;
  const StagePolicy stage = StagePolicy::for_stage(3);
  EXPECT_TRUE(UpdatePolicy::decide(s, stage, 1, true).params_stay_on_device);
  EXPECT_FALSE(UpdatePolicy::decide(s, stage, 1, false).params_stay_on_device);
  s.param_home = Tier::kHost;  // a host copy never gives way
  EXPECT_FALSE(UpdatePolicy::decide(s, stage, 1, true).params_stay_on_device);
  s.param_home = Tier::kNvme;
  s.update_behind = false;  // classic: the walk reads each shard from its home
  EXPECT_FALSE(UpdatePolicy::decide(s, stage, 1, true).params_stay_on_device);
}

HostRoomInputs three_groups() {
  return {.host_mem = 1000,
          .staging_bytes = 100,
          .host_home_bytes = 50,
          .nvme_accumulator_bytes = 200,
          .cpu_update_bytes = 40,
          .largest_unit_elements = 10,
          .pipeline_read = true,
          .group_state_bytes = {120, 80, 100},
          .group_read_bytes = {150, 100, 130},
          .all_param_bytes = 80};
}

TEST(HostRoom, ClassicReadsAsManyLargestGroupsAsFitBesideWhatTheHostHolds) {
  const HostRoom r = plan_host_room(three_groups());
  // held = 50 + 200 + 100 = 350; (1000 - 350) / 150 = 4 groups.
  EXPECT_EQ(r.groups_read_during_backward, 4u);
  // 1000 - (350 + 80 parameters).
  EXPECT_EQ(r.state_room, 570u);
  // beside = 80 + 50 + 100 + 120 (the largest state).
  EXPECT_EQ(r.largest_state, 120u);
  EXPECT_EQ(r.write_behind_room, 650u);
}

TEST(HostRoom, NoReadsWithoutPipelineReadOrRoom) {
  HostRoomInputs in = three_groups();
  in.pipeline_read = false;
  EXPECT_EQ(plan_host_room(in).groups_read_during_backward, 0u);
  in = three_groups();
  in.host_mem = 300;  // less than what the host holds anyway
  const HostRoom r = plan_host_room(in);
  EXPECT_EQ(r.groups_read_during_backward, 0u);
  EXPECT_EQ(r.state_room, 0u);
  EXPECT_EQ(r.write_behind_room, 0u);
}

TEST(HostRoom, ShardsOnTheDeviceCountOnlyTheTwoTheWalkWorksOn) {
  HostRoomInputs in = three_groups();
  in.params_stay_on_device = true;
  const HostRoom r = plan_host_room(in);
  EXPECT_EQ(r.groups_read_during_backward, (1000u - 390u) / 150u);  // held + 40
  EXPECT_EQ(r.state_room, 1000u - 390u);
  EXPECT_EQ(r.write_behind_room, 1000u - (40u + 50u + 100u + 120u));
}

TEST(HostRoom, FusedLeavesRoomForWritesOnlyWithTheShardsOnTheDevice) {
  HostRoomInputs in = three_groups();
  in.fused = true;
  EXPECT_EQ(plan_host_room(in).write_behind_room, 0u);
  in.params_stay_on_device = true;
  // 40 + 2 accumulators of 10 fp32 elements + 50 + 100 + 2 groups of 120.
  EXPECT_EQ(plan_host_room(in).write_behind_room, 1000u - (40u + 80u + 50u + 100u + 240u));
}

// Groups {0: unit 0}, {1: unit 1}, {2: unit 2}; pieces 0, 1, 2 in units 0, 1, 2.
WalkPlan three_units(HostRoom room = {}) {
  return WalkPlan({{0}, {1}, {2}}, {0, 1, 2}, 3, room, {30, 20, 10});
}

TEST(WalkPlan, StartsInDeclarationOrderAndFollowsTheBackwardOrder) {
  WalkPlan plan = three_units();
  EXPECT_EQ(plan.walk(), (std::vector<size_t>{0, 1, 2}));
  EXPECT_FALSE(plan.knows_first_uses());
  // Forward 0 1 2, backward 2 1 0: gradients are final in the backward order.
  plan.order({0, 1, 2, 2, 1, 0}, /*behind=*/false);
  EXPECT_EQ(plan.walk(), (std::vector<size_t>{2, 1, 0}));
  EXPECT_EQ(plan.rank_of(2), 0u);
  EXPECT_EQ(plan.rank_of(0), 2u);
  EXPECT_EQ(plan.rank_of(7), SIZE_MAX);
  EXPECT_TRUE(plan.knows_first_uses());
  EXPECT_EQ(plan.first_use(1), 1u);
  // Behind step() the walk goes in the order of the next forward pass.
  plan.order({0, 1, 2, 2, 1, 0}, /*behind=*/true);
  EXPECT_EQ(plan.walk(), (std::vector<size_t>{0, 1, 2}));
}

TEST(WalkPlan, AUnitTheTraceNeverUsesGoesLastAndTiesKeepTheirPlace) {
  WalkPlan plan = three_units();
  plan.order({2, 0, 0, 2}, /*behind=*/false);  // unit 1 unused: ready at the trace's end
  EXPECT_EQ(plan.walk(), (std::vector<size_t>{0, 2, 1}));
  EXPECT_EQ(plan.next_pass_tick(0, 4, 4), 5u * 4 + 1);
  EXPECT_EQ(plan.next_pass_tick(1, 4, 4), 5u * 4 + 4);  // no use: past the pass
}

TEST(WalkPlan, KeptStateAndWriteBehindTakeWhatFitsFromEachEnd) {
  WalkPlan plan = three_units({.state_room = 50, .write_behind_room = 45});
  // Walk 0 1 2 with 30, 20, 10 bytes: 30 + 20 fit in 50.
  EXPECT_EQ(plan.state_ranks_that_fit(), 2u);
  // Nothing kept: the last groups while they fit in 45 (10, then 20; 30 more would not).
  EXPECT_EQ(plan.write_behind_from(0), 1u);
  // One kept (30): 15 left, the last group (10) fits, the one before it does not.
  EXPECT_EQ(plan.write_behind_from(1), 2u);
  // Kept state fills the room: nothing is left for later.
  EXPECT_EQ(plan.write_behind_from(2), 3u);
}

TEST(WalkPlan, PiecesInWalkOrderLeaveOutEmptyGroups) {
  WalkPlan plan({{0, 1}, {2}, {3, 4}}, {0, 0, 1, 2, 2}, 3, {}, {0, 0, 0});
  plan.order({0, 1, 2, 2, 1, 0}, false);  // walk: group 2, 1, 0
  const auto todo = plan.pieces([](size_t pi) { return pi != 2 && pi != 3; });
  ASSERT_EQ(todo.size(), 2u);
  EXPECT_EQ(todo[0], (std::vector<size_t>{4}));
  EXPECT_EQ(todo[1], (std::vector<size_t>{0, 1}));
}

}  // namespace
}  // namespace zinf::engine_detail
