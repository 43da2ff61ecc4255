// Optimizer sub-groups: how owned ranges are cut into pieces and packed into groups.
#include "zinf/sched/sub_groups.h"

#include <gtest/gtest.h>

namespace zinf::sched {
namespace {

std::vector<std::vector<uint64_t>> group_sizes(const SubGroupPlan& p) {
  std::vector<std::vector<uint64_t>> out;
  for (const auto& g : p.groups) {
    out.emplace_back();
    for (size_t i : g) out.back().push_back(p.pieces[i].range.size());
  }
  return out;
}

TEST(SubGroups, LargeRangesAreCutAtAlignedOffsetsAndSmallOnesPacked) {
  // Unit 0 owns [1024, 1024 + 5000); unit 1 owns [0, 700); unit 2 owns [0, 300).
  auto plan = plan_sub_groups({{{1024, 6024}}, {{0, 700}}, {{0, 300}}}, 2000, 1024);
  // 2000 rounds up to 2048: unit 0 -> 2048, 2048, 904; then 904 + 700 fits 2048, + 300 too.
  ASSERT_EQ(plan.pieces.size(), 5u);
  EXPECT_EQ(plan.pieces[0].range.begin, 1024u);
  EXPECT_EQ(plan.pieces[1].range.begin, 1024u + 2048u);
  EXPECT_EQ(plan.pieces[2].range.end, 6024u);
  EXPECT_EQ(plan.pieces[3].unit, 1u);
  EXPECT_EQ(group_sizes(plan),
            (std::vector<std::vector<uint64_t>>{{2048}, {2048}, {904, 700, 300}}));
  uint64_t covered = 0;
  for (const Piece& p : plan.pieces) covered += p.range.size();
  EXPECT_EQ(covered, 5000u + 700u + 300u) << "pieces cover every owned element once";
}

TEST(SubGroups, ZeroMeansOneGroupPerUnit) {
  auto plan = plan_sub_groups({{{0, 5000}}, {{0, 10}}, {{0, 10}}}, 0, 1024);
  EXPECT_EQ(group_sizes(plan), (std::vector<std::vector<uint64_t>>{{5000}, {10}, {10}}));
}

TEST(SubGroups, PiecesNeverStraddleTwoRanksShards) {
  // Stage 0 holds every rank's shard: ranges [0, 3072) and [3072, 6144).
  auto plan = plan_sub_groups({{{0, 3072}, {3072, 6144}}}, 4096, 1024);
  ASSERT_EQ(plan.pieces.size(), 2u);
  EXPECT_EQ(plan.pieces[0].range.end, 3072u);
  EXPECT_EQ(plan.pieces[1].range.begin, 3072u);
  EXPECT_EQ(group_sizes(plan), (std::vector<std::vector<uint64_t>>{{3072}, {3072}}));
}

TEST(SubGroups, EmptyRangesMakeNoPiece) {
  auto plan = plan_sub_groups({{{64, 64}}, {{0, 8}}}, 100, 4);
  ASSERT_EQ(plan.pieces.size(), 1u);
  EXPECT_EQ(plan.pieces[0].unit, 1u);
  EXPECT_EQ(plan.groups.size(), 1u);
}

}  // namespace
}  // namespace zinf::sched
