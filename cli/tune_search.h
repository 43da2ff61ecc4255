// The search behind `zinf tune`: which I/O engine settings (block size, queue depth, rings,
// registered buffers) move a path's bytes fastest, found within a time budget without trying
// every combination. Pure over a measuring function, so tests drive it with a model of a disk.
//
// The walk (docs/tuning.md):
//  1. block size at queue depth 8, from 1 MiB up, then down; a direction stops after two
//     settings in a row score below 0.9 of the best so far (clearly worse: pruned);
//  2. queue depth at the best block size, from 8 up, then down, with the same rule;
//  3. block size again around the best (one step each way), at the best queue depth;
//  4. rings, from 1 up to `max_rings`, stopping at the first that scores below the best;
//  5. registered buffers off, at the best so far;
//  6. confirmation: the best `finalists` settings are measured again in alternating rounds for
//     the rest of the budget; the chosen one has the best median (one lucky run on a noisy disk
//     does not win).
// Settings over `max_in_flight_bytes` are skipped (a sweep direction ends there). A setting is
// never measured twice outside the confirmation. A measurement is started only if
// the time it is expected to take (the longest so far) fits in what is left of the budget; the
// sweeps keep a quarter of the budget for the confirmation.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::cli {

struct IoSetting {
  uint64_t block_size = 1 << 20;
  uint32_t queue_depth = 8;
  uint32_t rings = 1;
  bool fixed_buffers = true;
  auto operator<=>(const IoSetting&) const = default;
};

std::string describe(const IoSetting& s);  // "1 MiB x 8, 1 ring, registered"

struct IoMeasurement {
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
  // Throughput of an offloaded step's mix: it reads about twice what it writes (docs/estimate.md:
  // parameters read per use, optimizer state read and written once), so the time per byte is
  // weighted 2:1.
  double score() const;
};

struct IoTrial {
  IoSetting setting;
  IoMeasurement measured;
  std::string phase;   // "block size", "queue depth", "rings", "registered", "confirm"
  double seconds = 0;  // wall time of the measurement
};

using MeasureIo = std::function<Result<IoMeasurement>(const IoSetting&)>;

struct IoSearchOptions {
  std::vector<uint64_t> block_sizes = {128 << 10, 256 << 10, 512 << 10, 1 << 20,
                                       2 << 20,   4 << 20,   8 << 20};
  std::vector<uint32_t> queue_depths = {1, 2, 4, 8, 16, 32, 64};
  uint32_t max_rings = 2;
  size_t finalists = 3;
  double budget_seconds = 120;
  double prune_below = 0.9;  // a setting scoring under this share of the best is clearly worse
  // Settings that keep more bytes in flight (block size x queue depth x rings) are not tried:
  // the runtime keeps at most its staging buffers in flight, so a setting beyond them measures a
  // speed training never sees (and would ask for that much pinned staging memory).
  uint64_t max_in_flight_bytes = 64ull << 20;
  std::function<double()> clock;                 // seconds; default: steady_clock
  std::function<void(const IoTrial&)> on_trial;  // after each measurement (progress)
};

struct IoSearchResult {
  std::vector<IoTrial> trials;  // in the order measured, confirmation rounds included
  IoSetting best_tried;         // the highest single score of the sweeps
  IoSetting chosen;             // the best median over the confirmation (best_tried without one)
  double chosen_median_score = 0;
  int confirm_rounds = 0;
  bool budget_ran_out = false;  // the sweeps stopped early
};

// A measurement that fails fails the search, with the setting named in the error.
Result<IoSearchResult> search_io(const MeasureIo& measure, const IoSearchOptions& options);

}  // namespace zinf::cli
