// Scheduler: records the order in which a step uses its units (the trace) and, on later steps,
// plans along it: which units to fetch ahead, which to keep after use, when each is next used.
//
// It moves nothing itself; the engine asks and acts. Every answer depends only on the trace, the
// unit sizes, the options and what the engine reported live, so every rank of a data-parallel
// group that runs the same model gets the same answers, and collectives issued to prefetch
// (all-gathers) are issued in the same order on every rank.
//
// Recording and following:
//  - The first step records. At its end the trace is complete and later steps follow it.
//  - A use that differs from the trace is a departure: the uses so far plus this one become the
//    new trace, recording goes on to the end of the step, and plans stop until the next step.
//    A step that ends before its trace does is a departure too (the next step records afresh).
//    Nothing the engine holds becomes wrong: plans only make it fetch earlier or keep longer.
//
// Sizes are in parameter elements, as DeepSpeed's stage-3 keys count them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "zinf/core/tunables.h"

namespace zinf::sched {

struct SchedulerOptions {
  // stage3_prefetch_bucket_size: units along the trace are fetched ahead of use while the
  // elements of the units ahead (distinct, in trace order) stay below this. 0 = none.
  uint64_t prefetch_elements = tunables::kPrefetchBucket.value;
  // Reads from slower tiers start this many times further ahead than the gathers, so that a
  // unit's shard has arrived by the time its all-gather is issued.
  uint64_t read_ahead_factor = 2;
  // stage3_max_live_parameters: elements of the units live at once (in use, fetched ahead or
  // kept). Fetching ahead and keeping stop at this bound; the unit being used is always allowed.
  uint64_t max_live_elements = tunables::kMaxLive.value;
  // stage3_max_reuse_distance: a unit whose use ends stays live when it is used again within
  // this many elements of other units' uses. 0 = never kept.
  uint64_t max_reuse_distance = tunables::kMaxReuseDistance.value;
  // A unit's read ahead takes the room its gathered parameters will (one rank: the shard read to
  // the device is what the gather uses): reads ahead stay within max_live_elements as well.
  bool reads_in_live_room = false;
};

enum class Use {
  kRecording,  // no trace to follow yet (first step, or the step after a departure)
  kFollowing,  // this use is the one the trace predicted
  kDeparted,   // this use differs from the trace: recording starts over
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, std::vector<uint64_t> unit_elements);

  // Unit `unit` is about to be used.
  Use on_use(size_t unit);
  // The step ended. Returns false when the step ended before its trace did (a departure). A
  // step without any use changes nothing (a retried step, for example).
  bool on_step_end();

  bool following() const { return following_; }
  const std::vector<size_t>& trace() const { return trace_; }
  // Uses so far in this step.
  size_t position() const { return position_; }
  // Departures seen so far.
  uint64_t departures() const { return departures_; }
  const SchedulerOptions& options() const { return options_; }

  // The engine's report of which units hold their gathered parameters (live).
  void set_live(size_t unit, bool live);
  bool live(size_t unit) const { return live_[unit]; }
  uint64_t live_elements() const { return live_elements_; }

  // Units to gather now, in trace order: those in the prefetch window after the current use that
  // are not live, while the live elements stay within max_live_elements. Empty unless following.
  std::vector<size_t> gathers_ahead() const;
  // Units whose shards to start reading (from host or NVMe to the device) now: the not-live
  // units of a window read_ahead_factor times the prefetch window (with reads_in_live_room, while
  // they and the live elements stay within max_live_elements). Empty unless following.
  std::vector<size_t> reads_ahead() const;
  // Whether `unit`, whose use just ended, should stay live: it is used again in this step within
  // max_reuse_distance elements, and the live elements plus the largest unit to be gathered
  // before that reuse stay within max_live_elements.
  bool keep(size_t unit) const;
  // Position in the trace of the next use of `unit` after the current one (nullopt: not used
  // again this step, or not following).
  std::optional<size_t> next_use(size_t unit) const;

 private:
  // Distinct units of the uses after the current one, in order, while their elements (counting
  // each unit once) stay below `budget`.
  std::vector<size_t> window(uint64_t budget) const;

  SchedulerOptions options_;
  std::vector<uint64_t> elements_;
  std::vector<size_t> trace_;
  size_t position_ = 0;
  bool following_ = false;
  uint64_t departures_ = 0;
  std::vector<bool> live_;
  uint64_t live_elements_ = 0;
};

}  // namespace zinf::sched
