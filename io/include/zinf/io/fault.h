// FaultInjector: makes chosen I/O requests fail or complete short, so that every error path of
// the I/O stack and of the layers above it can be tested.
//
// Rules are set from tests (add/clear) or from the environment variable ZINF_IO_FAULTS, read
// once at first use: a comma-separated list of
//     OP:WHICH:KIND[:PATH_SUBSTRING]
//   OP    read | write | any       which submissions the rule watches
//         submit                   the rings' io_uring_enter calls instead (KIND eio | enospc |
//                                  eagain: the call fails with that errno; nothing is submitted)
//   WHICH N (the Nth matching submission, 1-based) | every | N+ (the Nth and every one after)
//   KIND  eio | enospc | eagain | short   complete with -EIO / -ENOSPC / -EAGAIN, or transfer
//                                        only part of the bytes
//         corrupt (reads only)     the read completes with one byte of the data flipped, as if
//                                  the disk (or another process) had changed the file
//         hang                     the chunk never completes (a lost request: tests the
//                                  deadlines of drain() and of the engine's destruction)
//   PATH_SUBSTRING (optional)       only files whose path contains it
// plus two special entries: `direct:refuse` (turning O_DIRECT on fails with EINVAL after the
// file was opened, or created, exercising the buffered fallback as on file systems that create
// the file before refusing O_DIRECT) and `fallocate:enospc` (preallocation fails as on a full
// disk). Example: ZINF_IO_FAULTS="write:3:eio,read:every:short"
//
// A "submission" is one request chunk handed to the kernel (a request larger than the block
// size is several chunks); continuations of short transfers and EAGAIN retries count too.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::io {

enum class IoOp : uint8_t { kRead, kWrite };
enum class FaultKind : uint8_t { kEio, kEnospc, kShort, kEagain, kCorrupt, kHang };
// What a rule watches: the requests' chunks, or the rings' io_uring_enter calls.
enum class FaultTarget : uint8_t { kChunks, kRingSubmit };

struct FaultRule {
  FaultTarget target = FaultTarget::kChunks;
  std::optional<IoOp> op;  // nullopt: reads and writes
  uint64_t nth = 1;        // 1-based index of the matching submission that fails
  bool and_after = false;  // also every matching submission after the nth
  FaultKind kind = FaultKind::kEio;
  std::string path_contains;  // empty: any file
};

class FaultInjector {
 public:
  static FaultInjector& global();

  void add(FaultRule rule);
  // Parses the ZINF_IO_FAULTS syntax and adds its rules; an error names the bad entry.
  Status add_spec(std::string_view spec);
  void clear();
  bool active() const { return active_.load(std::memory_order_relaxed); }

  bool refuse_direct() const { return refuse_direct_.load(std::memory_order_relaxed); }
  void set_refuse_direct(bool on);
  void set_fallocate_enospc(bool on);

  // Called for each submission; returns the fault to apply, if any.
  std::optional<FaultKind> on_submit(IoOp op, const std::string& path);
  // Called before each io_uring_enter of a ring; returns an errno to fail it with, if any.
  std::optional<int> on_ring_submit();
  // Called by File::preallocate; returns an errno to fail with, if any.
  std::optional<int> on_preallocate(const std::string& path);

  // How many faults fired since the last clear().
  uint64_t fired() const { return fired_.load(); }

 private:
  FaultInjector();
  void update_active();

  struct Entry {
    FaultRule rule;
    uint64_t seen = 0;
  };
  std::mutex mu_;
  std::vector<Entry> rules_;
  std::atomic<bool> active_{false};
  std::atomic<bool> refuse_direct_{false};
  std::atomic<bool> fallocate_enospc_{false};
  std::atomic<uint64_t> fired_{0};
};

}  // namespace zinf::io
