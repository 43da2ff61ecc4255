#include "zinf/zero/shard_layout.h"

#include <gtest/gtest.h>

namespace zinf::zero {
namespace {

UnitSpec block() {
  return {.name = "block0",
          .params = {{.name = "w", .shape = {30, 50}},
                     {.name = "b", .shape = {30}, .weight_decay = false}}};
}

TEST(ShardLayout, PadsToWholeBlocksPerRank) {
  for (int world : {1, 2, 3, 4}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      auto l = make_shard_layout(block(), world, dt);
      ASSERT_TRUE(l.is_ok());
      EXPECT_EQ(l->numel, 1530u);
      EXPECT_EQ(l->numel_padded % world, 0u);
      EXPECT_EQ(l->shard_numel * world, l->numel_padded);
      EXPECT_EQ(l->shard_numel * dtype_size(dt) % 4096, 0u) << world;
      EXPECT_EQ(l->shard_numel * 4 % 4096, 0u);                       // fp32 state shards too
      EXPECT_LT(l->numel_padded - l->numel, l->block_numel * world);  // no more than needed
      EXPECT_EQ(l->params[1].offset, 1500u);
    }
  }
}

TEST(ShardLayout, SegmentsSplitAtParametersAndPadding) {
  auto l = make_shard_layout(block(), 2, DType::kF32).value();
  auto segs = segments(l, 1000, 2048);  // the rest of w, all of b, then padding
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].begin, 1000u);
  EXPECT_EQ(segs[0].end, 1500u);
  EXPECT_TRUE(segs[0].weight_decay);
  EXPECT_EQ(segs[1].end, 1530u);
  EXPECT_FALSE(segs[1].weight_decay);
  EXPECT_EQ(segs[2].begin, 1530u);
  EXPECT_EQ(segs[2].end, 2048u);
  EXPECT_FALSE(segs[2].weight_decay);
}

TEST(ShardLayout, RejectsBadUnitsNamingThem) {
  UnitSpec dup{.name = "u", .params = {{.name = "a", .shape = {2}}, {.name = "a", .shape = {3}}}};
  auto r = make_shard_layout(dup, 2, DType::kF32);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("declared twice"), std::string::npos);
  UnitSpec neg{.name = "u", .params = {{.name = "w", .shape = {4, 0}}}};
  EXPECT_NE(make_shard_layout(neg, 2, DType::kF32).status().message().find("w"), std::string::npos);
  EXPECT_FALSE(make_shard_layout(UnitSpec{.name = "empty"}, 1, DType::kF32).is_ok());
  EXPECT_FALSE(make_shard_layout(block(), 0, DType::kF32).is_ok());
}

}  // namespace
}  // namespace zinf::zero
