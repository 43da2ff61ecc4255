// The scheduler's plans along a recorded trace: what is fetched ahead, what is kept, what
// happens when a step departs from the trace.
#include "zinf/sched/scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace zinf::sched {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Forward 0..3, backward 3..0 (as a 4-unit model uses them in one step).
const std::vector<size_t> kStep = {0, 1, 2, 3, 3, 2, 1, 0};

void run_step(Scheduler& s, const std::vector<size_t>& uses) {
  for (size_t u : uses) s.on_use(u);
}

TEST(Scheduler, RecordsTheFirstStepAndFollowsItAfterwards) {
  Scheduler s({.prefetch_elements = 250}, {100, 100, 100, 100});
  for (size_t u : kStep) {
    EXPECT_EQ(s.on_use(u), Use::kRecording);
    EXPECT_THAT(s.gathers_ahead(), IsEmpty()) << "no plan while recording";
  }
  EXPECT_TRUE(s.on_step_end());
  EXPECT_TRUE(s.following());
  EXPECT_EQ(s.trace(), kStep);
  for (size_t u : kStep) EXPECT_EQ(s.on_use(u), Use::kFollowing);
  EXPECT_TRUE(s.on_step_end());
  EXPECT_EQ(s.departures(), 0u);
}

TEST(Scheduler, GathersAheadWithinTheBucketAndTheLiveBound) {
  Scheduler s({.prefetch_elements = 250, .max_live_elements = 1000}, {100, 100, 100, 100});
  run_step(s, kStep);
  s.on_step_end();
  s.on_use(0);
  s.set_live(0, true);
  // Elements ahead stay below 250 before each addition: units 1, 2, 3 (100 + 100 + 100).
  EXPECT_THAT(s.gathers_ahead(), ElementsAre(1, 2, 3));
  // Reads look twice as far; unit 0 is live and not read again.
  EXPECT_THAT(s.reads_ahead(), ElementsAre(1, 2, 3));
  s.set_live(1, true);
  EXPECT_THAT(s.gathers_ahead(), ElementsAre(2, 3)) << "live units are not gathered again";

  Scheduler tight({.prefetch_elements = 250, .max_live_elements = 250}, {100, 100, 100, 100});
  run_step(tight, kStep);
  tight.on_step_end();
  tight.on_use(0);
  tight.set_live(0, true);
  EXPECT_THAT(tight.gathers_ahead(), ElementsAre(1)) << "100 live + 100 fits 250, +100 does not";
  EXPECT_EQ(tight.live_elements(), 100u);

  Scheduler off({.prefetch_elements = 0}, {100, 100, 100, 100});
  run_step(off, kStep);
  off.on_step_end();
  off.on_use(0);
  EXPECT_THAT(off.gathers_ahead(), IsEmpty());
  EXPECT_THAT(off.reads_ahead(), IsEmpty());
}

// One rank: a shard read to the device is the unit's gathered parameters to be, so reads ahead
// take live room too and stop, in order, where the live bound does.
TEST(Scheduler, ReadsAheadInTheLiveRoomStopAtTheLiveBound) {
  Scheduler s({.prefetch_elements = 250, .max_live_elements = 250, .reads_in_live_room = true},
              {100, 100, 100, 100});
  run_step(s, kStep);
  s.on_step_end();
  s.on_use(0);
  s.set_live(0, true);
  EXPECT_THAT(s.reads_ahead(), ElementsAre(1)) << "100 live + 100 fits 250, +100 does not";
  s.set_live(1, true);
  EXPECT_THAT(s.reads_ahead(), IsEmpty()) << "200 live: no room for another unit";
  s.set_live(0, false);
  EXPECT_THAT(s.reads_ahead(), ElementsAre(2));
  // Without the option the reads look twice the bucket ahead whatever is live.
  Scheduler apart({.prefetch_elements = 250, .max_live_elements = 250}, {100, 100, 100, 100});
  run_step(apart, kStep);
  apart.on_step_end();
  apart.on_use(0);
  apart.set_live(0, true);
  apart.set_live(1, true);
  EXPECT_THAT(apart.reads_ahead(), ElementsAre(2, 3));
}

TEST(Scheduler, TheBucketCountsEachUnitOnceAndStopsAtTheStepEnd) {
  Scheduler s({.prefetch_elements = 1000}, {100, 300, 50});
  run_step(s, {0, 1, 2, 2, 1, 0});
  s.on_step_end();
  run_step(s, {0, 1, 2, 2});
  // Ahead: 1, 0 (distinct); the next step's uses are not part of this step's plan.
  EXPECT_THAT(s.gathers_ahead(), ElementsAre(1, 0));
  Scheduler small({.prefetch_elements = 150}, {100, 300, 50});
  run_step(small, {0, 1, 2, 2, 1, 0});
  small.on_step_end();
  small.on_use(0);
  // 0 < 150: add unit 1 (300); 300 >= 150: stop.
  EXPECT_THAT(small.gathers_ahead(), ElementsAre(1));
  EXPECT_THAT(small.reads_ahead(), ElementsAre(1)) << "300 >= 2 x 150 as well";
}

TEST(Scheduler, KeepsAUnitReusedWithinTheDistance) {
  Scheduler s({.max_reuse_distance = 150}, {100, 100, 100, 100});
  run_step(s, kStep);
  s.on_step_end();
  run_step(s, {0, 1, 2, 3});
  EXPECT_TRUE(s.keep(3)) << "used again at once (distance 0)";
  EXPECT_TRUE(s.keep(2)) << "unit 3 (100) in between";
  EXPECT_FALSE(s.keep(1)) << "units 3 and 2 (200) in between";
  EXPECT_EQ(s.next_use(1), 6u);
  run_step(s, {3, 2, 1, 0});
  EXPECT_FALSE(s.keep(0)) << "not used again this step";
  EXPECT_EQ(s.next_use(0), std::nullopt);

  Scheduler never({.max_reuse_distance = 0}, {100, 100, 100, 100});
  run_step(never, kStep);
  never.on_step_end();
  run_step(never, {0, 1, 2, 3});
  EXPECT_FALSE(never.keep(3)) << "0 keeps nothing";

  Scheduler full({.max_live_elements = 150, .max_reuse_distance = 1000}, {100, 100, 100, 100});
  run_step(full, kStep);
  full.on_step_end();
  run_step(full, {0, 1, 2, 3});
  full.set_live(3, true);
  full.set_live(2, true);
  EXPECT_FALSE(full.keep(3)) << "200 live elements exceed the 150 bound";
  full.set_live(2, false);
  EXPECT_TRUE(full.keep(3)) << "reused at once: nothing else to gather meanwhile";
  full.on_use(3);
  EXPECT_FALSE(full.keep(3)) << "unit 2 (100) must be gathered beside it: 200 > 150";
  full.set_live(2, true);
  EXPECT_FALSE(full.keep(3));
  full.set_live(3, false);
  EXPECT_TRUE(full.keep(2)) << "its next use comes next: 100 live fits";
}

TEST(Scheduler, ADepartureRerecordsFromTheMatchingPrefix) {
  Scheduler s({.prefetch_elements = 1000}, {100, 100, 100, 100});
  run_step(s, kStep);
  s.on_step_end();
  EXPECT_EQ(s.on_use(0), Use::kFollowing);
  EXPECT_EQ(s.on_use(2), Use::kDeparted);  // skipped unit 1
  EXPECT_FALSE(s.following());
  EXPECT_THAT(s.gathers_ahead(), IsEmpty()) << "no plans until the new trace is complete";
  EXPECT_FALSE(s.keep(2));
  run_step(s, {3, 3, 2, 0});
  EXPECT_TRUE(s.on_step_end());
  EXPECT_THAT(s.trace(), ElementsAre(0, 2, 3, 3, 2, 0));
  EXPECT_EQ(s.departures(), 1u);
  for (size_t u : {0, 2, 3, 3, 2, 0}) EXPECT_EQ(s.on_use(u), Use::kFollowing);
  EXPECT_TRUE(s.on_step_end());
}

TEST(Scheduler, AStepEndingEarlyIsADeparture) {
  Scheduler s({}, {100, 100, 100, 100});
  run_step(s, kStep);
  s.on_step_end();
  run_step(s, {0, 1, 2, 3});  // forward only (an evaluation step, say)
  EXPECT_FALSE(s.on_step_end());
  EXPECT_FALSE(s.following());
  EXPECT_EQ(s.departures(), 1u);
  for (size_t u : kStep) EXPECT_EQ(s.on_use(u), Use::kRecording);
  EXPECT_TRUE(s.on_step_end());
  EXPECT_EQ(s.trace(), kStep);
}

TEST(Scheduler, AStepWithoutUsesChangesNothing) {
  Scheduler s({}, {100});
  EXPECT_TRUE(s.on_step_end());
  EXPECT_FALSE(s.following());
  EXPECT_EQ(s.on_use(0), Use::kRecording);
  EXPECT_TRUE(s.on_step_end());
  EXPECT_TRUE(s.following());
  EXPECT_TRUE(s.on_step_end()) << "a retried step() without uses is not a departure";
  EXPECT_TRUE(s.following());
  EXPECT_EQ(s.departures(), 0u);
}

}  // namespace
}  // namespace zinf::sched
