// The I/O benchmark behind `zinf bench io`: the same access pattern as fio's io_uring engine with
// direct=1 (one file, `threads` rings, each keeping `queue_depth` blocks in flight over its own
// contiguous region), timed from the first submission to the last completion.
//
// The file is created with O_DIRECT in `directory`, preallocated, written (untimed, for the read
// patterns), then exercised; every 4 KiB sector carries a stamp of its file offset, so reads are
// verified as they complete (a few bytes per sector: no cost to the measurement), and after a
// timed write the file is read back and verified untimed. The file is removed in every case.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "zinf/core/status.h"

namespace zinf::io {

enum class BenchPattern { kRead, kWrite, kRandRead, kRandWrite };

const char* pattern_name(BenchPattern p);
Result<BenchPattern> parse_pattern(const std::string& s);

struct IoBenchOptions {
  std::string directory;
  uint64_t size = 1ull << 30;
  uint64_t block_size = 1ull << 20;
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
  BenchPattern pattern = BenchPattern::kRead;
  uint64_t seed = 1;
  bool fixed_buffers = true;
};

struct IoBenchResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double bytes_per_s = 0;
  double iops = 0;
  bool direct = true;  // false when the file system refused O_DIRECT
  uint64_t verified_sectors = 0;
  std::string file;  // the (now removed) benchmark file
};

// Called about every 200 ms during the timed phase: (phase name, bytes done, bytes total, seconds).
using IoBenchProgress = std::function<void(const char*, uint64_t, uint64_t, double)>;

// Checks options and the directory (exists, is writable, has room) before touching the disk.
Status validate_io_bench(const IoBenchOptions& options);
Result<IoBenchResult> run_io_bench(const IoBenchOptions& options,
                                   const IoBenchProgress& progress = {});

}  // namespace zinf::io
