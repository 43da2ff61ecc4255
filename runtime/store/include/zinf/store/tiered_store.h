// TieredTensorStore: every tensor (a shard, or a unit's flat buffer) has a home tier, where it
// always has storage, and may have copies in the tiers above it (device above host above NVMe).
//
// Contract
//  - create() allocates the home storage, zero-filled, valid. The home is never evicted.
//  - prefetch(id, tier) starts making the tier hold a valid copy and returns at once; errors of a
//    prefetch are reported by the acquire() that needs it. A prefetch is a hint: where the tier
//    has no room for it, it evicts only what it may (below) and otherwise gives up (no copy, no
//    error); the acquire then fetches on demand.
//  - acquire(id, tier) returns a handle whose data() stays valid and resident in `tier` until
//    the handle is released (destroyed); it waits only for what is still in flight: a move into
//    that copy, and the store's own copies out of it (a write-back, a move into another tier),
//    since the caller may write through the handle at once. Several handles may pin the same
//    copy. A writer calls mark_dirty() on its handle, before or after writing and before
//    releasing it: that copy becomes the only valid one (the others are stale until refreshed
//    or written back).
//  - From mark_dirty() (or an acquire for kOverwrite) until that handle is released, nothing is
//    copied out of its copy: an acquire of the tensor in another tier, and flush(), wait for
//    the release (and fail with kInvalidArgument if the calling thread holds that handle: the
//    wait would never end). Prefetches and evictions, which run later on a mover, never copy
//    out of a pinned copy at all. A pinned copy not marked dirty may still be read for another
//    thread's acquire of another tier: a writer that shares a tensor with other threads
//    announces its writes (mark_dirty first, or kOverwrite) before making them.
//  - When a tier is over its budget (the Device's budget for kDevice, the PinnedPool's for
//    kHost) copies that are not pinned are dropped: clean ones first, dirty ones after being
//    written back to their home; copies that a move brought and nobody has acquired since
//    ("awaiting use": read ahead, or landed for an acquire not yet awake) after the other clean
//    ones; within each kind by farthest next use (set_next_use) when known, least recently used
//    otherwise. Nothing pinned is ever evicted; if everything is, acquire fails with
//    kOutOfMemory naming the tensor, the tier and the budget.
//    A prefetch never evicts a copy awaiting use (prefetches are issued in the order of use, so
//    that copy is needed before the one being fetched: evicting it only reads it twice), and with
//    PrefetchRoom::kCleanOnly it evicts no dirty copy either (no write-back on its account).
//  - Moves: NVMe -> device and device -> NVMe go through `staging_buffers` pinned staging
//    buffers in pieces of `staging_bytes`, so the NVMe transfers of the next pieces overlap the
//    copy of the current one; host <-> NVMe moves read and write the host copy directly.
//  - Errors from below (I/O error, no space, no memory) reach the caller of acquire(), evict()
//    or flush() with the tensor named; the data stays valid in the tier that still holds it.
//  - Thread-safe. Moves run on `movers` threads owned by the store.
//
// Locking (tiered_store.cc). Three mutexes, each with its condition variable:
//  - `mu` (with `cv`) guards the tensors and their copies (validity, pins, readers, writers,
//    moves in flight), the clock, the statistics and the ordered-prefetch generation. Allocation
//    and eviction under a tier's budget happen with it held; it is released while bytes move
//    (transfer() and the zeroing of new device storage run unlocked) and in cv waits.
//  - `jobs_mu` (with `jobs_cv`) guards the movers' queues (`urgent`, `jobs`) and `stopping`. A
//    mover holds it only to take a job, and runs the job after releasing it.
//  - `lanes_mu` (with `lanes_cv`) guards the free transfer lanes (staging buffers and a stream).
// Order: `mu` before `jobs_mu` (a move is queued with `mu` held; nothing takes `mu` while holding
// `jobs_mu`). `lanes_mu` is a leaf taken with neither of the others held: a thread waiting for a
// lane holds no store lock, so a transfer in progress can always finish and give its lane back.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/io/swap_space.h"
#include "zinf/memory/accounting.h"
#include "zinf/memory/device.h"
#include "zinf/memory/pinned_pool.h"

namespace zinf {

using TensorId = uint32_t;

// What the caller of acquire() will do with the bytes.
enum class Access : uint8_t {
  kRead,       // read (and maybe modify): the copy must hold the current contents
  kOverwrite,  // overwrite every byte: no need to fetch the old contents (the copy becomes the
               // only valid one at once, as after mark_dirty)
};

struct TensorSpec {
  std::string name;  // appears in every error about this tensor
  uint64_t bytes = 0;
  Tier home = Tier::kDevice;
  MemoryCategory category = MemoryCategory::kParameters;
};

struct StoreOptions {
  Device* device = nullptr;       // the kDevice tier (budgeted by the device)
  PinnedPool* host = nullptr;     // the kHost tier (budgeted by the pool) and staging
  io::SwapSpace* swap = nullptr;  // the kNvme tier; required for tensors homed there
  Ledger* ledger = nullptr;       // NVMe bytes are accounted here (device/host by their owners)
  uint64_t staging_bytes = 2ull << 20;  // piece size of NVMe <-> device moves (multiple of 1 MiB)
  uint32_t staging_buffers = 4;         // pieces in flight per move (at least 2)
  uint32_t movers = 2;
  std::string trace_name = "store";  // prefix of this store's tracks in a trace (e.g. "rank0")
};

// What a prefetch may evict to make room for its copy (beside copies awaiting use, which it never
// evicts).
enum class PrefetchRoom : uint8_t {
  kAny,        // clean copies, and dirty ones after writing them back (as an acquire)
  kCleanOnly,  // clean copies only: a prefetch that would cost a write-back gives up instead
};

struct StoreStats {
  uint64_t moves = 0;  // copies produced
  uint64_t bytes_to_device = 0;
  uint64_t bytes_to_host = 0;
  uint64_t bytes_nvme_read = 0;
  uint64_t bytes_nvme_written = 0;
  uint64_t evictions = 0;            // copies dropped to make room
  uint64_t writebacks = 0;           // dirty copies written to their home
  uint64_t stale_discards = 0;       // moves whose result was outdated by a write meanwhile
  uint64_t discards = 0;             // dirty copies dropped unwritten by discard() (dead contents)
  uint64_t prefetches_given_up = 0;  // prefetches that found no room they were allowed to take
};

struct Residency {
  bool allocated[kNumTiers] = {};
  bool valid[kNumTiers] = {};
  int pins[kNumTiers] = {};
};

class TieredTensorStore;

class TensorHandle {
 public:
  TensorHandle() = default;
  TensorHandle(TensorHandle&& o) noexcept { *this = std::move(o); }
  TensorHandle& operator=(TensorHandle&& o) noexcept;
  TensorHandle(const TensorHandle&) = delete;
  TensorHandle& operator=(const TensorHandle&) = delete;
  ~TensorHandle() { release(); }

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }  // padded to 4 KiB
  Tier tier() const { return tier_; }
  TensorId id() const { return id_; }
  explicit operator bool() const { return store_ != nullptr; }
  // The bytes in this copy were (or will be) modified: the other copies are now stale.
  void mark_dirty();
  void release();

 private:
  friend class TieredTensorStore;
  TieredTensorStore* store_ = nullptr;
  TensorId id_ = 0;
  Tier tier_ = Tier::kDevice;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  bool writing_ = false;    // announced writes (mark_dirty, kOverwrite) until released
  std::thread::id writer_;  // the thread that announced them
};

class TieredTensorStore {
 public:
  static Result<std::unique_ptr<TieredTensorStore>> create(const StoreOptions& options);
  ~TieredTensorStore();
  TieredTensorStore(const TieredTensorStore&) = delete;
  TieredTensorStore& operator=(const TieredTensorStore&) = delete;

  Result<TensorId> create_tensor(const TensorSpec& spec);
  // The tensor must not be pinned. Frees every copy.
  Status destroy_tensor(TensorId id);

  // Device memory outside any tensor (gathered units, gradient buffers), under the same budget:
  // cached copies are evicted to make room. `what` names the request in errors.
  Result<DeviceBuffer> allocate_device(uint64_t bytes, MemoryCategory category,
                                       const std::string& what);

  void prefetch(TensorId id, Tier tier, PrefetchRoom room = PrefetchRoom::kAny);
  // Prefetches `copies` (tensor, tier) one after another on one mover, in the order given, and
  // stops at the first that finds no room it may take: a later, smaller one must not take the
  // room an earlier one (needed sooner) would then have to evict it for. A copy acquired since
  // the call is passed over (its user fetched it); one already there counts as awaiting use. A
  // newer call supersedes an older one that has not finished (it stops before its next copy); an
  // empty list only stops the older one.
  void prefetch_in_order(std::vector<std::pair<TensorId, Tier>> copies, PrefetchRoom room);
  Result<TensorHandle> acquire(TensorId id, Tier tier, Access access = Access::kRead);
  // Drops the copy in `tier` (not the home), writing it back first when it is the only valid one.
  // Waits for the store's own moves into or out of that copy; a copy pinned by a handle is an
  // error.
  Status evict(TensorId id, Tier tier);
  // evict() on a mover thread, for copies that are neither pinned nor being filled (others are
  // left alone: the future reports ok). The future reports a failed write-back.
  std::shared_future<Status> evict_async(TensorId id, Tier tier);
  // On a mover thread: writes the copy in `tier` back to the home when it is the only valid one,
  // and keeps it (clean: a later eviction just drops it), for a use soon. A copy being written by
  // a handle, or already moving, is left alone (the future reports ok); the future reports a
  // failed write-back.
  std::shared_future<Status> write_back_async(TensorId id, Tier tier);
  // The caller no longer needs the tensor's contents (a gradient accumulator whose update is
  // done): the copy in `tier` (not the home) is dropped without being written back, and the
  // tensor's contents are unspecified until it is next written (in practice the home's older
  // bytes, which still pass their checksums). A copy in use (pinned, being filled, read or written
  // back) or with another valid copy beside it is left as it is, and the call changes nothing:
  // the copy then goes the usual way. Saves writing dead data to NVMe.
  Status discard(TensorId id, Tier tier);
  // Makes the home copy valid (writes back a dirty copy). flush_all() does every tensor.
  Status flush(TensorId id);
  Status flush_all();
  // Scheduling hint: the tick at which the tensor will next be used (larger = later).
  void set_next_use(TensorId id, uint64_t tick);
  // Forgets that hint: the next use is unknown again (such copies are evicted first, least
  // recently used first).
  void clear_next_use(TensorId id);
  // The copy in `tier`, when it is there, counts as awaiting use until its next acquire, like a
  // copy read ahead: no prefetch evicts it, and a demand for room takes it only after the other
  // clean copies. For a copy made now for a use that comes later (the engine's host copy of a
  // unit's parameters kept for the unit's update, which may lag behind the backward pass).
  void keep_for_use(TensorId id, Tier tier);

  const TensorSpec& spec(TensorId id) const;
  uint64_t padded_bytes(TensorId id) const;
  Residency residency(TensorId id) const;
  StoreStats stats() const;
  size_t tensor_count() const;

  struct Impl;

 private:
  friend class TensorHandle;
  explicit TieredTensorStore(std::unique_ptr<Impl> impl);
  void unpin(const TensorHandle& h);
  void dirty(TensorHandle& h);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf
