// The I/O benchmark behind `zinf bench io` and `zinf tune`: the same access pattern as fio's
// io_uring engine with direct=1 (`threads` rings, each keeping `queue_depth` blocks in flight over
// its own contiguous region), timed from the first submission to the last completion.
//
// One file is created with O_DIRECT in each of `directories`; with several, block i goes to file
// i mod n (striped, as the swap space stripes extents). Files are preallocated, written (untimed,
// for the read patterns), then exercised; every 4 KiB sector carries a stamp of its file and
// offset, so reads are verified as they complete (a few bytes per sector: no cost to the
// measurement), and after a timed write the files are read back and verified (timed as
// `read_back_bytes_per_s` when `time_read_back`). The files are removed in every case.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::io {

enum class BenchPattern { kRead, kWrite, kRandRead, kRandWrite };

const char* pattern_name(BenchPattern p);
Result<BenchPattern> parse_pattern(const std::string& s);

struct IoBenchOptions {
  std::vector<std::string> directories;
  uint64_t size = 1ull << 30;
  uint64_t block_size = 1ull << 20;
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
  BenchPattern pattern = BenchPattern::kRead;
  uint64_t seed = 1;
  bool fixed_buffers = true;
  bool defer_taskrun = true;    // IoEngineOptions::defer_taskrun
  bool time_read_back = false;  // write patterns: time the verifying read too
};

struct IoBenchResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double bytes_per_s = 0;
  double iops = 0;
  bool direct = true;     // false when the file system refused O_DIRECT
  bool deferred = false;  // the rings were created SINGLE_ISSUER | DEFER_TASKRUN
  uint64_t verified_sectors = 0;
  double read_back_bytes_per_s = 0;  // write patterns with time_read_back
  std::vector<std::string> files;    // the (now removed) benchmark files
};

// Called about every 200 ms during the timed phase: (phase name, bytes done, bytes total, seconds).
using IoBenchProgress = std::function<void(const char*, uint64_t, uint64_t, double)>;

// Checks options and the directory (exists, is writable, has room) before touching the disk.
Status validate_io_bench(const IoBenchOptions& options);
Result<IoBenchResult> run_io_bench(const IoBenchOptions& options,
                                   const IoBenchProgress& progress = {});

}  // namespace zinf::io
