// The search behind `zinf tune` (cli/tune_search.h), driven by models of a disk and a fake clock.
#include "tune_search.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace zinf::cli {
namespace {

// A disk whose throughput peaks at 2 MiB x 16, one ring, registered buffers, falling off
// smoothly away from there (read 2x write); each measurement takes a second of fake time.
struct Disk {
  double now = 0;
  int measured = 0;
  IoMeasurement at(const IoSetting& s) const {
    const double b = std::log2(static_cast<double>(s.block_size) / (2 << 20));
    const double q = std::log2(s.queue_depth / 16.0);
    double gbps = 2.0 / (1.0 + 0.3 * b * b + 0.2 * q * q);
    if (s.rings > 1) gbps *= 0.9;
    if (!s.fixed_buffers) gbps *= 0.95;
    return {.read_bytes_per_s = 2 * gbps * 1e9, .write_bytes_per_s = gbps * 1e9};
  }
  MeasureIo measure() {
    return [this](const IoSetting& s) -> Result<IoMeasurement> {
      now += 1;
      ++measured;
      return at(s);
    };
  }
  IoSearchOptions options(double budget) {
    IoSearchOptions o;
    o.budget_seconds = budget;
    o.clock = [this] { return now; };
    return o;
  }
};

TEST(TuneSearch, FindsThePeakWithoutTryingEveryCombination) {
  Disk disk;
  auto r = search_io(disk.measure(), disk.options(60));
  ASSERT_TRUE(r.is_ok()) << r.status().detail();
  const IoSetting peak{.block_size = 2 << 20, .queue_depth = 16, .rings = 1, .fixed_buffers = true};
  EXPECT_EQ(r->best_tried, peak) << describe(r->best_tried);
  EXPECT_EQ(r->chosen, peak) << describe(r->chosen);
  // 7 block sizes x 7 depths x 2 ring counts x 2 = 196 combinations; the walk prunes.
  size_t sweeps = 0;
  for (const IoTrial& t : r->trials) sweeps += t.phase != "confirm";
  EXPECT_LE(sweeps, 20u);
  EXPECT_FALSE(r->budget_ran_out);
  // The rest of the budget went to confirming the finalists, and the budget was kept.
  EXPECT_GE(r->confirm_rounds, 1);
  EXPECT_LE(disk.now, 60.0);
  EXPECT_NEAR(r->chosen_median_score, disk.at(peak).score(), 1e-6 * disk.at(peak).score());
}

// Nothing beyond what the runtime's staging keeps in flight is measured, even where the model
// disk would be faster (its peak, 2 MiB x 16 = 32 MiB, lies beyond a 16 MiB cap).
TEST(TuneSearch, StaysWithinTheBytesInFlight) {
  Disk disk;
  IoSearchOptions o = disk.options(60);
  o.max_in_flight_bytes = 16 << 20;
  auto r = search_io(disk.measure(), o);
  ASSERT_TRUE(r.is_ok());
  for (const IoTrial& t : r->trials) {
    EXPECT_LE(t.setting.block_size * t.setting.queue_depth * t.setting.rings, 16u << 20)
        << describe(t.setting);
  }
  EXPECT_LE(r->chosen.block_size * r->chosen.queue_depth, 16u << 20);
  EXPECT_GE(r->chosen_median_score,
            0.9 * disk.at({.block_size = 2 << 20, .queue_depth = 8}).score());
}

TEST(TuneSearch, KeepsItsBudget) {
  Disk disk;
  auto r = search_io(disk.measure(), disk.options(6));
  ASSERT_TRUE(r.is_ok());
  EXPECT_LE(disk.now, 6.0);
  EXPECT_TRUE(r->budget_ran_out);
  EXPECT_EQ(r->trials.size(), static_cast<size_t>(disk.measured));
}

// One lucky measurement does not win: 4 MiB x 8 is measured once at 1.5x its true speed, which
// beats the true peak in the sweeps; the confirmation rounds measure both again and the
// median picks the true peak.
TEST(TuneSearch, ConfirmationOutvotesALuckyRun) {
  Disk disk;
  const IoSetting lucky{.block_size = 4 << 20, .queue_depth = 8};
  std::map<IoSetting, int> seen;
  MeasureIo measure = [&](const IoSetting& s) -> Result<IoMeasurement> {
    disk.now += 1;
    IoMeasurement m = disk.at(s);
    if (s == lucky && seen[s]++ == 0) {
      m.read_bytes_per_s *= 1.5;
      m.write_bytes_per_s *= 1.5;
    }
    return m;
  };
  auto r = search_io(measure, disk.options(60));
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->best_tried, lucky) << describe(r->best_tried);
  EXPECT_NE(r->chosen, lucky) << describe(r->chosen);
  EXPECT_GE(r->confirm_rounds, 2);
}

TEST(TuneSearch, AFailedMeasurementIsAnErrorNamingTheSetting) {
  Disk disk;
  MeasureIo measure = [&](const IoSetting& s) -> Result<IoMeasurement> {
    disk.now += 1;
    if (s.queue_depth == 32) return make_error(ErrorCode::kIo, "disk full");
    return disk.at(s);
  };
  auto r = search_io(measure, disk.options(60));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("x 32"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("disk full"), std::string::npos);
}

}  // namespace
}  // namespace zinf::cli
