#include "zinf/store/tiered_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <mutex>
#include <thread>

#include "zinf/core/log.h"
#include "zinf/core/trace.h"
#include "zinf/core/units.h"

namespace zinf {
namespace {

constexpr uint64_t kUnknownUse = std::numeric_limits<uint64_t>::max();

struct Job {
  bool done = false;
  Status status;
  bool demanded = false;                   // an acquire waits for it (a prefetch alone is a hint)
  PrefetchRoom room = PrefetchRoom::kAny;  // what the prefetch may evict (until demanded)
  bool gave_up = false;  // a prefetch found no room it may take: nothing moved, not an error
  bool started = false;  // a mover took it (it may be queued twice: see start_move())
};

struct Copy {
  bool allocated = false;
  bool valid = false;
  bool writing_back = false;  // this copy is being written to its home
  int pins = 0;               // handles held by callers
  int reads = 0;              // moves and write-backs reading this copy right now
  // The threads of held handles that announced writes (mark_dirty, or acquire for kOverwrite):
  // the bytes may change until those handles are released, so nothing is copied out meanwhile.
  std::vector<std::thread::id> writers;

  DeviceBuffer dev;
  PinnedBuffer host;
  void* ptr = nullptr;            // device or host data; null for NVMe
  std::shared_ptr<Job> incoming;  // a move filling this copy
  uint64_t last_use = 0;          // clock of the last acquire (of the arrival, while awaiting use)
  bool awaiting = false;          // brought by a move (a prefetch's or not), not acquired since

  // Something holds or moves these bytes: the copy may be neither dropped nor freed now.
  bool busy() const { return pins > 0 || reads > 0 || incoming || writing_back; }
};

struct Tensor {
  TensorSpec spec;
  uint64_t padded = 0;
  uint64_t version = 0;  // bumped by every mark_dirty: moves started before it are stale
  io::ExtentId extent = 0;
  Copy copies[kNumTiers];
  uint64_t next_use = kUnknownUse;
  uint64_t last_acquired = 0;  // clock of the last acquire of any of its copies
  bool creating = false;       // published while its home storage is being placed: not usable yet
};

// A staging pair and a copy stream: what one transfer needs.
struct Lane {
  std::vector<PinnedBuffer> staging;
  std::unique_ptr<Stream> stream;
};

int idx(Tier t) { return static_cast<int>(t); }

// Who asks for a move or a write-back: what it may read (see move() and write_back()).
enum class MoveFor : uint8_t { kPrefetch, kAcquire };
enum class WriteBackFor : uint8_t { kFlush, kEviction };

}  // namespace

struct TieredTensorStore::Impl {
  StoreOptions o;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Tensor>> tensors;  // index: TensorId; null once destroyed
  uint64_t clock = 0;
  StoreStats stats;
  uint64_t ordered_generation = 0;  // bumped by each prefetch_in_order(): older ones stop

  // Mover threads.
  std::deque<std::function<void()>> jobs;
  // Moves an acquire waits for: a mover takes them before `jobs` (write-backs, evictions and
  // prefetches queued earlier do not hold up a use that is waiting).
  std::deque<std::function<void()>> urgent;
  std::condition_variable jobs_cv;
  bool stopping = false;
  std::vector<std::thread> movers;

  // Transfer lanes.
  std::mutex lanes_mu;
  std::condition_variable lanes_cv;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::vector<Lane*> free_lanes;

  explicit Impl(const StoreOptions& options) : o(options) {}

  Tensor* get(TensorId id) const { return id < tensors.size() ? tensors[id].get() : nullptr; }

  // ---- lanes ---------------------------------------------------------------------------------
  Lane* take_lane() {
    std::unique_lock lock(lanes_mu);
    lanes_cv.wait(lock, [&] { return !free_lanes.empty(); });
    Lane* l = free_lanes.back();
    free_lanes.pop_back();
    return l;
  }
  void give_lane(Lane* l) {
    {
      std::lock_guard lock(lanes_mu);
      free_lanes.push_back(l);
    }
    lanes_cv.notify_one();
  }

  // ---- data movement (no store lock held) ----------------------------------------------------
  Status zero_device(void* ptr, uint64_t bytes) {
    Lane* lane = take_lane();
    o.device->fill({.data = ptr, .dtype = DType::kF32, .numel = bytes / 4}, 0.0f, *lane->stream);
    Status s = lane->stream->record().wait();
    if (!s.is_ok()) (void)lane->stream->synchronize();
    give_lane(lane);
    return s;
  }

  struct Endpoint {
    Tier tier;
    void* ptr;            // device/host memory
    io::ExtentId extent;  // NVMe
  };

  Status transfer(const Endpoint& src, const Endpoint& dst, uint64_t bytes) {
    if (src.tier != Tier::kNvme && dst.tier != Tier::kNvme) {
      Lane* lane = take_lane();
      o.device->copy_async(dst.ptr, src.ptr, bytes, *lane->stream);
      Status s = lane->stream->record().wait();
      if (!s.is_ok()) (void)lane->stream->synchronize();
      give_lane(lane);
      return s;
    }
    if (src.tier == Tier::kHost) return o.swap->write(dst.extent, src.ptr);
    if (dst.tier == Tier::kHost) return o.swap->read(src.extent, dst.ptr);
    Lane* lane = take_lane();
    Status s = src.tier == Tier::kNvme ? nvme_to_device(*lane, src.extent, dst.ptr, bytes)
                                       : device_to_nvme(*lane, src.ptr, dst.extent, bytes);
    give_lane(lane);
    return s;
  }

  // K-buffered: reads of pieces i+1..i+K-1 are in flight while piece i is copied to the device.
  Status nvme_to_device(Lane& lane, io::ExtentId extent, void* dst, uint64_t bytes) {
    const uint64_t piece = o.staging_bytes;
    const uint64_t n = (bytes + piece - 1) / piece;
    const uint64_t k = lane.staging.size();
    std::vector<std::future<Status>> reads(n);
    std::vector<io::ReadCheck> checks(n);  // verified here, not on the ring's thread
    std::vector<Event> copied(n);
    uint64_t next_read = 0;
    Status first_error;
    auto issue_read = [&](uint64_t j) {
      auto p = std::make_shared<std::promise<Status>>();
      reads[j] = p->get_future();
      uint64_t len = std::min(piece, bytes - j * piece);
      Status s = o.swap->read_range_async(
          extent, j * piece, len, lane.staging[j % k].data(),
          [p](Status st) { p->set_value(std::move(st)); }, checks[j]);
      if (!s.is_ok()) p->set_value(std::move(s));
    };
    // Reads up to piece `limit`; piece j reuses buffer j % k once piece j - k was copied out.
    auto refill = [&](uint64_t limit) {
      while (first_error.is_ok() && next_read < n && next_read <= limit) {
        if (next_read >= k) {
          Status c = copied[next_read - k].wait();
          if (!c.is_ok()) {
            first_error = std::move(c);
            return;
          }
        }
        issue_read(next_read++);
      }
    };
    refill(k - 1);
    for (uint64_t i = 0; i < n && first_error.is_ok(); ++i) {
      Status r = reads[i].get();
      if (r.is_ok()) r = o.swap->verify(checks[i]);
      if (!r.is_ok()) {
        first_error = std::move(r);
        break;
      }
      uint64_t len = std::min(piece, bytes - i * piece);
      o.device->copy_async(static_cast<char*>(dst) + i * piece, lane.staging[i % k].data(), len,
                           *lane.stream);
      copied[i] = lane.stream->record();
      refill(i + k);
    }
    // Nothing may still write into the staging buffers when we return.
    for (uint64_t j = 0; j < next_read; ++j) {
      if (reads[j].valid()) (void)reads[j].get();
    }
    Status tail = lane.stream->synchronize();
    if (first_error.is_ok()) first_error = std::move(tail);
    return first_error;
  }

  // K-buffered: up to K NVMe writes in flight; piece i is copied out of the device into buffer
  // i % K once the write of piece i - K (the buffer's last user) has finished.
  Status device_to_nvme(Lane& lane, const void* src, io::ExtentId extent, uint64_t bytes) {
    const uint64_t piece = o.staging_bytes;
    const uint64_t n = (bytes + piece - 1) / piece;
    const uint64_t k = lane.staging.size();
    std::vector<std::future<Status>> writes(n);
    Status first_error;
    auto note = [&](Status s) {
      if (first_error.is_ok() && !s.is_ok()) first_error = std::move(s);
    };
    for (uint64_t i = 0; i < n && first_error.is_ok(); ++i) {
      if (i >= k) note(writes[i - k].get());
      if (!first_error.is_ok()) break;
      uint64_t len = std::min(piece, bytes - i * piece);
      o.device->copy_async(lane.staging[i % k].data(), static_cast<const char*>(src) + i * piece,
                           len, *lane.stream);
      note(lane.stream->record().wait());
      if (!first_error.is_ok()) break;
      auto p = std::make_shared<std::promise<Status>>();
      writes[i] = p->get_future();
      Status s = o.swap->write_range_async(extent, i * piece, len, lane.staging[i % k].data(),
                                           [p](Status st) { p->set_value(std::move(st)); });
      if (!s.is_ok()) p->set_value(std::move(s));
    }
    for (auto& w : writes) {
      if (w.valid()) note(w.get());
    }
    note(lane.stream->synchronize());
    return first_error;
  }

  // The trace track of a move between two tiers.
  std::string track(Tier from, Tier to) const {
    const char* kind = from == Tier::kNvme ? "nvme read"
                       : to == Tier::kNvme ? "nvme write"
                                           : "copy";
    return o.trace_name + " " + kind;
  }

  Endpoint endpoint(const Tensor& t, Tier tier) const {
    return Endpoint{tier, t.copies[idx(tier)].ptr, t.extent};
  }

  // ---- copies (store lock held) ---------------------------------------------------------------
  // The copy a move into `dst` reads: the nearest valid one.
  static Tier source_for(const Tensor& t, Tier dst) {
    static constexpr Tier kOrder[kNumTiers][2] = {
        {Tier::kHost, Tier::kNvme}, {Tier::kDevice, Tier::kNvme}, {Tier::kHost, Tier::kDevice}};
    const Tier nearest = kOrder[idx(dst)][0];
    return t.copies[idx(nearest)].valid ? nearest : kOrder[idx(dst)][1];
  }

  // Whether the calling thread holds a handle that writes `c` (waiting for it would hang).
  static bool written_by_caller(const Copy& c) {
    return std::find(c.writers.begin(), c.writers.end(), std::this_thread::get_id()) !=
           c.writers.end();
  }

  static bool only_valid_copy(const Tensor& t, Tier tier) {
    for (int k = 0; k < kNumTiers; ++k) {
      if (k != idx(tier) && t.copies[k].valid) return false;
    }
    return t.copies[idx(tier)].valid;
  }

  void free_copy(Tensor& t, Tier tier) {
    Copy& c = t.copies[idx(tier)];
    c.dev.reset();
    c.host.reset();
    c.ptr = nullptr;
    c.allocated = false;
    c.valid = false;
    c.awaiting = false;
  }

  Status allocate_storage(Tensor& t, Tier tier) {
    Copy& c = t.copies[idx(tier)];
    if (tier == Tier::kDevice) {
      if (o.device == nullptr) {
        return make_error(ErrorCode::kInvalidArgument, "the store has no device tier");
      }
      ZINF_ASSIGN_OR_RETURN(c.dev, o.device->allocate(t.padded, t.spec.category));
      c.ptr = c.dev.data();
    } else if (tier == Tier::kHost) {
      if (o.host == nullptr) {
        return make_error(ErrorCode::kInvalidArgument, "the store has no host tier");
      }
      ZINF_ASSIGN_OR_RETURN(c.host, o.host->allocate(t.padded, t.spec.category));
      c.ptr = c.host.data();
    } else {
      return make_error(ErrorCode::kInvalidArgument,
                        "NVMe holds only tensors homed there (tensor {})", t.spec.name);
    }
    c.allocated = true;
    return Status::ok();
  }

  // Picks the copy in `tier` to drop: clean before dirty, copies awaiting use after the others,
  // then farthest next use, then least recently used. For a prefetch (`for_prefetch`), only
  // copies it may take: none awaiting use, no dirty one with PrefetchRoom::kCleanOnly. Returns
  // the tensor id or -1.
  int64_t pick_victim(Tier tier, const Job* for_prefetch = nullptr) const {
    int64_t best = -1;
    std::tuple<bool, bool, uint64_t, uint64_t> best_key;
    for (size_t id = 0; id < tensors.size(); ++id) {
      const Tensor* t = tensors[id].get();
      if (!may_evict(t, tier, for_prefetch)) continue;
      const Copy& c = t->copies[idx(tier)];
      const bool dirty = only_valid_copy(*t, tier);
      const bool awaiting = c.awaiting && c.valid;  // (a stale copy awaits nothing)
      // Smaller key = better victim. Among copies awaiting use, the one that came last: they
      // were read ahead in the order of use, so it is needed last.
      auto key = std::make_tuple(dirty, awaiting, kUnknownUse - t->next_use,
                                 awaiting ? kUnknownUse - c.last_use : c.last_use);
      if (best < 0 || key < best_key) {
        best = static_cast<int64_t>(id);
        best_key = key;
      }
    }
    return best;
  }

  // Whether tensor `t`'s copy in `tier` may be dropped now (by a prefetch: see pick_victim()).
  bool may_evict(const Tensor* t, Tier tier, const Job* for_prefetch) const {
    if (t == nullptr || t->spec.home == tier) return false;
    const Copy& c = t->copies[idx(tier)];
    if (!c.allocated || c.busy()) return false;
    // A dirty copy's write-back would wait for a move into its home that may be queued behind
    // the mover doing this eviction: leave such copies alone.
    if (t->copies[idx(t->spec.home)].incoming) return false;
    if (for_prefetch == nullptr) return true;
    if (c.awaiting && c.valid) return false;
    return !(for_prefetch->room == PrefetchRoom::kCleanOnly && only_valid_copy(*t, tier));
  }

  // Whether a copy in `tier` is held only while data moves (being filled, read as a source or
  // written back) and nobody uses it: once that ends it may be evicted. A demand for memory that
  // found no victim waits for such a copy instead of failing: a read ahead still landing is not
  // a copy in use.
  bool victim_settling(Tier tier) const {
    for (const auto& tp : tensors) {
      const Tensor* t = tp.get();
      if (t == nullptr || t->creating || t->spec.home == tier) continue;
      const Copy& c = t->copies[idx(tier)];
      if (!c.allocated || c.pins > 0) continue;
      if (c.incoming || c.reads > 0 || c.writing_back || t->copies[idx(t->spec.home)].incoming) {
        return true;
      }
    }
    return false;
  }

  // Whether `bytes` could be had in `tier` by evicting what a prefetch may take: the room left
  // under the budget plus those copies. Checked before a prefetch evicts anything, so one that
  // would give up anyway takes nothing from the others. (An estimate: an allocator's rounding
  // can still make it give up later.)
  bool prefetch_room_reachable(Tier tier, uint64_t bytes, const Job* for_prefetch) const {
    uint64_t budget = 0, in_use = 0;
    if (tier == Tier::kDevice && o.device != nullptr) {
      budget = o.device->budget_bytes();
      in_use = o.device->bytes_in_use();
    } else if (tier == Tier::kHost && o.host != nullptr) {
      budget = o.host->budget_bytes();
      in_use = o.host->stats().bytes_in_use;
    } else {
      return true;
    }
    uint64_t room = budget > in_use ? budget - in_use : 0;
    for (const auto& t : tensors) {
      if (room >= bytes) return true;
      if (may_evict(t.get(), tier, for_prefetch)) room += t->padded;
    }
    return room >= bytes;
  }

  // Writes the valid copy in `tier` back to the (stale) home. Unlocks while the data moves.
  // For an eviction, a copy that was pinned meanwhile is left alone (drop() will not free it).
  Status write_back(std::unique_lock<std::mutex>& lk, TensorId id, Tier tier, WriteBackFor why) {
    Tensor* t = get(id);
    Copy& c = t->copies[idx(tier)];
    Copy& home = t->copies[idx(t->spec.home)];
    // One write-back at a time per tensor.
    cv.wait(lk, [&] { return !c.writing_back && !home.incoming; });
    if (home.valid || !c.valid) return Status::ok();  // nothing (left) to write back
    // Still being written: not now (flush() waits for the writer). A copy in use may be written
    // before its holder calls mark_dirty(): an eviction does not read it.
    if (!c.writers.empty() || (why == WriteBackFor::kEviction && c.pins > 0)) return Status::ok();
    c.writing_back = true;
    ++c.reads;
    uint64_t version = t->version;
    Endpoint src = endpoint(*t, tier), dst = endpoint(*t, t->spec.home);
    auto job = std::make_shared<Job>();
    job->started = true;
    home.incoming = job;
    std::string name = t->spec.name;
    lk.unlock();
    Status s;
    {
      trace::Span span(track(tier, t->spec.home), name);
      s = transfer(src, dst, t->padded);
    }
    lk.lock();
    home.incoming.reset();
    job->status = s;
    job->done = true;  // an acquire of the home may be waiting on this write-back
    --c.reads;
    c.writing_back = false;
    if (s.is_ok()) {
      ++stats.writebacks;
      count_bytes(tier, t->spec.home, t->padded);
      if (t->version == version) home.valid = true;
    }
    cv.notify_all();
    if (!s.is_ok()) {
      return std::move(s).with_context(fmt::format("writing tensor {} back from {} to {}",
                                                   t->spec.name, tier_name(tier),
                                                   tier_name(t->spec.home)));
    }
    return Status::ok();
  }

  // Drops a victim's copy (written back first when dirty). Unlocks while writing back.
  Status drop(std::unique_lock<std::mutex>& lk, TensorId id, Tier tier) {
    Tensor* t = get(id);
    if (only_valid_copy(*t, tier))
      ZINF_RETURN_IF_ERROR(write_back(lk, id, tier, WriteBackFor::kEviction));
    t = get(id);
    if (t == nullptr) return Status::ok();
    Copy& c = t->copies[idx(tier)];
    if (!c.allocated || c.busy() || only_valid_copy(*t, tier)) {
      return Status::ok();  // it became busy meanwhile: the caller looks again
    }
    free_copy(*t, tier);
    ++stats.evictions;
    return Status::ok();
  }

  // Drops one unpinned copy from `tier` to make room (one a prefetch may take, for a prefetch
  // job). kOutOfMemory when nothing can go.
  Status evict_one(std::unique_lock<std::mutex>& lk, Tier tier, const Job* for_prefetch = nullptr) {
    int64_t victim = pick_victim(tier, for_prefetch);
    if (victim < 0) {
      return make_error(ErrorCode::kOutOfMemory, "every resident copy in the {} tier is in use",
                        tier_name(tier));
    }
    return drop(lk, static_cast<TensorId>(victim), tier);
  }

  // Gives tensor `id` storage in `tier`, evicting others under the budget. Unlocks while
  // writing victims back. For a move that only a prefetch wants (`job` not demanded), only what
  // a prefetch may evict: when that is not enough, nothing is evicted (as far as can be told
  // beforehand), `job->gave_up` is set and no storage is made. An acquire joining meanwhile
  // lifts the limit at the next victim.
  Status make_copy_storage(std::unique_lock<std::mutex>& lk, TensorId id, Tier tier,
                           Job* job = nullptr) {
    bool checked_room = false;
    while (true) {
      Tensor* t = get(id);
      Status s = allocate_storage(*t, tier);
      if (s.is_ok() || s.code() != ErrorCode::kOutOfMemory) {
        return s.is_ok() ? s : std::move(s).with_context("tensor " + t->spec.name);
      }
      const Job* for_prefetch = job != nullptr && !job->demanded ? job : nullptr;
      if (for_prefetch != nullptr && !checked_room) {
        checked_room = true;
        if (!prefetch_room_reachable(tier, t->padded, for_prefetch)) {
          job->gave_up = true;
          return Status::ok();
        }
      }
      Status e = evict_one(lk, tier, for_prefetch);
      if (e.code() == ErrorCode::kOutOfMemory && for_prefetch != nullptr) {
        job->gave_up = true;
        return Status::ok();
      }
      if (e.code() == ErrorCode::kOutOfMemory) {
        return std::move(s).with_context(fmt::format(
            "tensor {} ({}) does not fit in the {} tier and every resident copy is in use",
            t->spec.name, format_bytes(static_cast<double>(t->padded)), tier_name(tier)));
      }
      ZINF_RETURN_IF_ERROR(e);
    }
  }

  void count_bytes(Tier from, Tier to, uint64_t bytes) {
    if (to == Tier::kDevice) stats.bytes_to_device += bytes;
    if (to == Tier::kHost) stats.bytes_to_host += bytes;
    if (from == Tier::kNvme) stats.bytes_nvme_read += bytes;
    if (to == Tier::kNvme) stats.bytes_nvme_written += bytes;
  }

  // Makes tensor `id`'s copy in `dst` valid, for `job`. Runs on a mover thread with the lock
  // held; unlocks while data moves.
  Status move(std::unique_lock<std::mutex>& lk, TensorId id, Tier dst, Job& job) {
    Tensor* t = get(id);
    if (!t->copies[idx(dst)].allocated) {
      ZINF_RETURN_IF_ERROR(make_copy_storage(lk, id, dst, &job));
      if (job.gave_up) {  // a prefetch with no room it may take: not an error
        ++stats.prefetches_given_up;
        return Status::ok();
      }
    }
    t = get(id);
    Copy& d = t->copies[idx(dst)];
    if (d.valid) return Status::ok();
    const Tier src = source_for(*t, dst);
    Copy& sc = t->copies[idx(src)];
    ZINF_CHECK(sc.valid, "tensor {} has no valid copy", t->spec.name);
    // Being written (since this move was queued): the acquire that needs this copy waits for the
    // writer's release and moves again.
    if (!sc.writers.empty()) return Status::ok();
    // In use: its holder may write it before calling mark_dirty(). Only an acquire that needs
    // this copy (made on demand, by a thread that is waiting) reads it; a prefetch does not.
    if (!job.demanded && sc.pins > 0) return Status::ok();
    ++sc.reads;
    uint64_t version = t->version;
    Endpoint from = endpoint(*t, src), to = endpoint(*t, dst);
    std::string name = t->spec.name;
    lk.unlock();
    Status s;
    {
      trace::Span span(track(src, dst), name);
      s = transfer(from, to, t->padded);
    }
    lk.lock();
    --sc.reads;
    if (!s.is_ok()) {
      // Give the memory back, unless someone pinned the copy meanwhile (and maybe wrote it).
      if (dst != t->spec.home && d.pins == 0 && !d.valid) free_copy(*t, dst);
      return std::move(s).with_context(fmt::format("moving tensor {} from {} to {}", t->spec.name,
                                                   tier_name(src), tier_name(dst)));
    }
    count_bytes(src, dst, t->padded);
    ++stats.moves;
    if (t->version != version) {
      ++stats.stale_discards;  // written meanwhile: the acquire that needs it moves again
      return Status::ok();
    }
    d.valid = true;
    // Awaiting use until acquired, also when an acquire waits for it: that acquire takes the copy
    // only once woken, and meanwhile a prefetch (this mover's ordered list going on to its next
    // copy, say) must not evict it: it would be read twice.
    d.awaiting = true;
    d.last_use = ++clock;  // its arrival (see pick_victim())
    return Status::ok();
  }

  // Starts a move into `tier` unless the copy is valid or already coming. Lock held.
  std::shared_ptr<Job> start_move(TensorId id, Tier tier, MoveFor why,
                                  PrefetchRoom room = PrefetchRoom::kAny) {
    Copy& c = tensors[id]->copies[idx(tier)];
    const bool demanded = why == MoveFor::kAcquire;
    if (c.incoming) {
      // A prefetch still queued that an acquire now waits for: queued again among the urgent
      // moves (whichever copy a mover takes first runs it; the other finds it started).
      const bool promote = demanded && !c.incoming->demanded && !c.incoming->started;
      c.incoming->demanded = c.incoming->demanded || demanded;
      if (promote) enqueue_move(id, tier, c.incoming, /*urgent=*/true);
      return c.incoming;
    }
    if (c.valid) return nullptr;
    auto job = std::make_shared<Job>();
    job->demanded = demanded;
    job->room = room;
    c.incoming = job;
    enqueue_move(id, tier, job, demanded);
    return job;
  }

  void enqueue_move(TensorId id, Tier tier, const std::shared_ptr<Job>& job, bool is_urgent) {
    {
      std::lock_guard jl(jobs_mu);
      (is_urgent ? urgent : jobs).push_back([this, id, tier, job] {
        std::unique_lock lk(mu);
        if (job->started) return;
        job->started = true;
        Status s = move(lk, id, tier, *job);
        if (Tensor* t = get(id); t && t->copies[idx(tier)].incoming == job) {
          t->copies[idx(tier)].incoming.reset();
        }
        job->status = std::move(s);
        job->done = true;
        cv.notify_all();
      });
    }
    jobs_cv.notify_one();
  }

  std::mutex jobs_mu;

  // Runs `act` on a mover thread, store lock held, for the copy in `tier` when nobody uses it;
  // otherwise (the tensor gone or being created, the copy its home, absent or busy, a move into
  // the home pending) the future reports ok without acting. Never waits: a mover waiting for a
  // move queued behind it would deadlock.
  std::shared_future<Status> on_idle_copy(
      TensorId id, Tier tier, std::function<Status(std::unique_lock<std::mutex>&)> act) {
    auto promise = std::make_shared<std::promise<Status>>();
    std::shared_future<Status> future = promise->get_future().share();
    {
      std::lock_guard jl(jobs_mu);
      jobs.push_back([this, id, tier, promise, act = std::move(act)] {
        std::unique_lock lk(mu);
        const Tensor* t = get(id);
        const bool idle = t != nullptr && tier != t->spec.home && !t->creating &&
                          t->copies[idx(tier)].allocated && !t->copies[idx(tier)].busy() &&
                          !t->copies[idx(t->spec.home)].incoming;
        promise->set_value(idle ? act(lk) : Status::ok());
      });
    }
    jobs_cv.notify_one();
    return future;
  }

  void mover_loop() {
    while (true) {
      std::function<void()> work;
      {
        std::unique_lock lock(jobs_mu);
        jobs_cv.wait(lock, [&] { return stopping || !jobs.empty() || !urgent.empty(); });
        std::deque<std::function<void()>>& from = urgent.empty() ? jobs : urgent;
        if (from.empty()) return;
        work = std::move(from.front());
        from.pop_front();
      }
      work();
    }
  }
};

// ---- TensorHandle -------------------------------------------------------------------------------

TensorHandle& TensorHandle::operator=(TensorHandle&& o) noexcept {
  if (this != &o) {
    release();
    store_ = std::exchange(o.store_, nullptr);
    id_ = o.id_;
    tier_ = o.tier_;
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
    writing_ = std::exchange(o.writing_, false);
    writer_ = o.writer_;
  }
  return *this;
}

void TensorHandle::mark_dirty() {
  ZINF_CHECK(store_ != nullptr, "mark_dirty on an empty handle");
  store_->dirty(*this);
}

void TensorHandle::release() {
  if (store_ != nullptr) store_->unpin(*this);
  store_ = nullptr;
  data_ = nullptr;
  writing_ = false;
}

// ---- TieredTensorStore --------------------------------------------------------------------------

TieredTensorStore::TieredTensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<TieredTensorStore>> TieredTensorStore::create(const StoreOptions& options) {
  if (options.movers == 0 || options.movers > 64) {
    return make_error(ErrorCode::kInvalidArgument, "movers must be 1..64, got {}", options.movers);
  }
  if (options.staging_bytes == 0 || options.staging_bytes % io::SwapSpace::kChecksumBlock != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "staging size must be a positive multiple of 1 MiB, got {}",
                      options.staging_bytes);
  }
  if (options.device != nullptr && options.swap != nullptr && options.host != nullptr) {
    // Each lane (one per mover, one for callers) stages its NVMe moves in buffers of its own.
    const uint64_t lanes = options.movers + 1;
    const uint64_t buffers = std::max<uint32_t>(options.staging_buffers, 2);
    const uint64_t need = lanes * buffers * options.staging_bytes;
    if (need > options.host->budget_bytes()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "host budget {} is too small for the NVMe staging buffers: {} lanes x {} "
                        "buffers x {} = {}; raise the host budget or lower the staging size",
                        format_bytes(static_cast<double>(options.host->budget_bytes())), lanes,
                        buffers, format_bytes(static_cast<double>(options.staging_bytes)),
                        format_bytes(static_cast<double>(need)));
    }
  }
  auto impl = std::make_unique<Impl>(options);
  if (options.device != nullptr) {
    // One lane per mover plus one for callers that flush or evict on their own thread.
    for (uint32_t i = 0; i <= options.movers; ++i) {
      auto lane = std::make_unique<Lane>();
      lane->stream = options.device->create_stream(fmt::format("store-copy-{}", i));
      if (options.swap != nullptr) {
        if (options.host == nullptr) {
          return make_error(ErrorCode::kInvalidArgument,
                            "NVMe <-> device moves need a pinned host pool for staging");
        }
        for (uint32_t b = 0; b < std::max<uint32_t>(options.staging_buffers, 2); ++b) {
          auto buf = options.host->allocate(options.staging_bytes, MemoryCategory::kBuffers);
          if (!buf.is_ok()) {
            return std::move(buf).take_status().with_context("allocating staging buffers");
          }
          lane->staging.push_back(std::move(buf).value());
        }
      }
      impl->free_lanes.push_back(lane.get());
      impl->lanes.push_back(std::move(lane));
    }
  }
  Impl* raw = impl.get();
  for (uint32_t i = 0; i < options.movers; ++i) {
    impl->movers.emplace_back([raw] { raw->mover_loop(); });
  }
  return std::unique_ptr<TieredTensorStore>(new TieredTensorStore(std::move(impl)));
}

TieredTensorStore::~TieredTensorStore() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.jobs_mu);
    s.stopping = true;
  }
  s.jobs_cv.notify_all();
  for (auto& t : s.movers) t.join();
  std::lock_guard lock(s.mu);
  for (size_t id = 0; id < s.tensors.size(); ++id) {
    Tensor* t = s.tensors[id].get();
    if (t == nullptr) continue;
    for (int k = 0; k < kNumTiers; ++k) {
      ZINF_CHECK(t->copies[k].pins == 0, "store destroyed while tensor {} is pinned", t->spec.name);
      s.free_copy(*t, static_cast<Tier>(k));
    }
    if (t->extent) {
      (void)s.o.swap->free(t->extent);
      if (s.o.ledger) s.o.ledger->sub(Tier::kNvme, t->spec.category, t->padded);
    }
  }
  s.tensors.clear();
  s.lanes.clear();
}

Result<TensorId> TieredTensorStore::create_tensor(const TensorSpec& spec) {
  Impl& s = *impl_;
  if (spec.bytes == 0) {
    return make_error(ErrorCode::kInvalidArgument, "tensor {} has no bytes", spec.name);
  }
  auto t = std::make_unique<Tensor>();
  t->spec = spec;
  t->padded = align_up(spec.bytes, 4096);
  if (spec.home == Tier::kNvme) {
    // The extent is allocated and zero-filled before the tensor becomes visible.
    if (s.o.swap == nullptr || s.o.host == nullptr) {
      return make_error(ErrorCode::kInvalidArgument,
                        "tensor {} is homed on NVMe but the store has no swap space or host pool",
                        spec.name);
    }
    ZINF_ASSIGN_OR_RETURN(t->extent, s.o.swap->allocate(t->padded, spec.name));
    Status zs;
    {
      auto zeros = s.o.host->allocate(std::min<uint64_t>(t->padded, s.o.staging_bytes),
                                      MemoryCategory::kBuffers);
      if (!zeros.is_ok()) {
        zs = zeros.status();
      } else {
        std::memset(zeros->data(), 0, zeros->bytes());
        for (uint64_t off = 0; off < t->padded && zs.is_ok(); off += zeros->bytes()) {
          zs = s.o.swap->write_range(t->extent, off, std::min(zeros->bytes(), t->padded - off),
                                     zeros->data());
        }
      }
    }
    if (!zs.is_ok()) {
      (void)s.o.swap->free(t->extent);
      return std::move(zs).with_context("initialising tensor " + spec.name + " on NVMe");
    }
    if (s.o.ledger) s.o.ledger->add(Tier::kNvme, spec.category, t->padded);
    t->copies[idx(Tier::kNvme)].allocated = true;
    t->copies[idx(Tier::kNvme)].valid = true;
    std::lock_guard lk(s.mu);
    s.tensors.push_back(std::move(t));
    return static_cast<TensorId>(s.tensors.size() - 1);
  }
  // The home copy is placed like any copy (evicting others' cached copies if needed).
  std::unique_lock lk(s.mu);
  TensorId id = static_cast<TensorId>(s.tensors.size());
  t->creating = true;
  s.tensors.push_back(std::move(t));
  Status st = s.make_copy_storage(lk, id, spec.home);
  if (!st.is_ok()) {
    s.tensors[id].reset();
    return st;
  }
  Tensor* placed = s.get(id);
  if (spec.home == Tier::kDevice) {
    // Device memory is reached only through the device's operations.
    void* ptr = placed->copies[idx(spec.home)].ptr;
    const uint64_t bytes = placed->padded;
    lk.unlock();
    Status zs = s.zero_device(ptr, bytes);
    lk.lock();
    placed = s.get(id);
    if (!zs.is_ok()) {
      s.tensors[id].reset();
      return std::move(zs).with_context("zeroing tensor " + spec.name + " on the device");
    }
  } else {
    std::memset(placed->copies[idx(spec.home)].ptr, 0, placed->padded);
  }
  placed->copies[idx(spec.home)].valid = true;
  placed->creating = false;
  return id;
}

Status TieredTensorStore::destroy_tensor(TensorId id) {
  Impl& s = *impl_;
  std::unique_lock lk(s.mu);
  Tensor* t = s.get(id);
  if (t == nullptr) return make_error(ErrorCode::kNotFound, "tensor {} does not exist", id);
  for (int k = 0; k < kNumTiers; ++k) {
    const Copy& c = t->copies[k];
    if (c.busy()) {
      return make_error(ErrorCode::kInvalidArgument, "tensor {} is in use and cannot be destroyed",
                        t->spec.name);
    }
  }
  for (int k = 0; k < kNumTiers; ++k) s.free_copy(*t, static_cast<Tier>(k));
  if (t->extent) {
    (void)s.o.swap->free(t->extent);
    if (s.o.ledger) s.o.ledger->sub(Tier::kNvme, t->spec.category, t->padded);
  }
  s.tensors[id].reset();
  return Status::ok();
}

Result<DeviceBuffer> TieredTensorStore::allocate_device(uint64_t bytes, MemoryCategory category,
                                                        const std::string& what) {
  Impl& s = *impl_;
  if (s.o.device == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "the store has no device tier");
  }
  std::unique_lock lk(s.mu);
  while (true) {
    auto b = s.o.device->allocate(bytes, category);
    if (b.is_ok() || b.status().code() != ErrorCode::kOutOfMemory) {
      return b.is_ok() ? std::move(b) : std::move(b).take_status().with_context(what);
    }
    Status e = s.evict_one(lk, Tier::kDevice);
    if (e.code() == ErrorCode::kOutOfMemory) {
      // A copy moving now (a read ahead landing, a write-back) is a victim once it has moved:
      // the caller is not a mover, so the movers finish it while this waits.
      if (s.victim_settling(Tier::kDevice)) {
        s.cv.wait_for(lk, std::chrono::milliseconds(50));
        continue;
      }
      return std::move(b).take_status().with_context(what + " (every resident copy is in use)");
    }
    ZINF_RETURN_IF_ERROR(e);
  }
}

void TieredTensorStore::prefetch(TensorId id, Tier tier, PrefetchRoom room) {
  Impl& s = *impl_;
  if (tier == Tier::kNvme) return;
  std::lock_guard lk(s.mu);
  const Tensor* t = s.get(id);
  if (t == nullptr || t->creating) return;
  const Copy& c = t->copies[idx(tier)];
  // Nothing is copied out of a copy in use on its own: its holder may be writing it.
  if (!c.valid && !c.incoming && t->copies[idx(Impl::source_for(*t, tier))].pins > 0) return;
  s.start_move(id, tier, MoveFor::kPrefetch, room);
}

void TieredTensorStore::prefetch_in_order(std::vector<std::pair<TensorId, Tier>> copies,
                                          PrefetchRoom room) {
  Impl& s = *impl_;
  uint64_t generation, issued;
  {
    std::lock_guard lk(s.mu);
    generation = ++s.ordered_generation;
    issued = s.clock;
  }
  if (copies.empty()) return;  // (the older list stops all the same)
  {
    std::lock_guard jl(s.jobs_mu);
    s.jobs.push_back([this, copies = std::move(copies), room, generation, issued] {
      Impl& s = *impl_;
      std::unique_lock lk(s.mu);
      for (const auto& [id, tier] : copies) {
        if (s.ordered_generation != generation) return;  // a newer list took over
        Tensor* t = s.get(id);
        if (tier == Tier::kNvme || t == nullptr || t->creating) continue;
        // Used since the list was asked for: whoever needed it fetched it (reading it again now,
        // after it may have been written out or dropped, would be a wasted read).
        if (t->last_acquired > issued) continue;
        Copy& c = t->copies[idx(tier)];
        if (c.incoming) continue;  // coming (with its storage, or demanded)
        if (c.valid) {  // already there: kept for its use like a copy read ahead (arriving now)
          c.awaiting = true;
          c.last_use = ++s.clock;
          continue;
        }
        // Its source is in use (its holder may be writing it): not now, nor anything after it.
        if (t->copies[idx(Impl::source_for(*t, tier))].pins > 0) return;
        auto job = std::make_shared<Job>();
        job->room = room;
        job->started = true;  // run here, on this mover (an acquire joining it waits for it)
        c.incoming = job;
        Status st = s.move(lk, id, tier, *job);
        t = s.get(id);
        const bool landed = t != nullptr && t->copies[idx(tier)].valid;
        if (t != nullptr && t->copies[idx(tier)].incoming == job) {
          t->copies[idx(tier)].incoming.reset();
        }
        job->status = std::move(st);
        job->done = true;
        s.cv.notify_all();
        // No room it may take (or an error, which the acquire that needs it reports): the
        // copies after this one wait, or they would take room this one needs first.
        if (!landed) return;
      }
    });
  }
  s.jobs_cv.notify_one();
}

Result<TensorHandle> TieredTensorStore::acquire(TensorId id, Tier tier, Access access) {
  Impl& s = *impl_;
  std::unique_lock lk(s.mu);
  if (s.get(id) == nullptr || s.get(id)->creating) {
    return make_error(ErrorCode::kNotFound, "tensor {} does not exist", id);
  }
  if (tier == Tier::kNvme) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor {}: acquire() gives memory on the device or host tier, not NVMe",
                      s.get(id)->spec.name);
  }
  while (true) {
    Tensor* t = s.get(id);
    Copy& c = t->copies[idx(tier)];
    // The store may be copying out of these bytes with the lock released (a write-back, to flush
    // or to evict, or a move into another tier). The caller may write through the handle as soon
    // as it holds it, and nothing orders that write after the store's read: the two would race,
    // and the read's result would be a mix of old and new bytes, marked valid in the other tier
    // if it landed before the caller's mark_dirty(). So no handle while a copy out is in flight;
    // each such copy is a bounded transfer that needs nothing from the caller to finish.
    if (c.reads > 0) {
      s.cv.wait(lk, [&] { return c.reads == 0; });
      continue;
    }
    if (access == Access::kOverwrite && !c.valid) {
      if (c.incoming || c.writing_back) {  // let what is in flight land first
        auto job = c.incoming;
        s.cv.wait(lk, [&] { return !c.writing_back && (!job || job->done); });
        continue;
      }
      if (!c.allocated) {
        ZINF_RETURN_IF_ERROR(s.make_copy_storage(lk, id, tier));
        continue;  // the lock was released: look again
      }
      // Nothing to fetch: this copy becomes the current contents (the caller overwrites it).
      c.valid = true;
    }
    if (access == Access::kOverwrite && c.valid && !c.incoming) {
      // The other copies are stale from now on, as after mark_dirty().
      ++t->version;
      for (int k = 0; k < kNumTiers; ++k) {
        if (k != idx(tier)) t->copies[k].valid = false;
      }
    }
    if (c.valid && !c.incoming) {
      ++c.pins;
      c.awaiting = false;
      c.last_use = ++s.clock;
      t->last_acquired = c.last_use;
      TensorHandle h;
      h.store_ = this;
      h.id_ = id;
      h.tier_ = tier;
      h.data_ = c.ptr;
      h.bytes_ = t->padded;
      if (access == Access::kOverwrite) {  // a writer from the start, as after mark_dirty()
        h.writing_ = true;
        h.writer_ = std::this_thread::get_id();
        c.writers.push_back(h.writer_);
      }
      return h;
    }
    if (!c.incoming) {
      // A move would read the nearest valid copy: not while a handle that writes it is held.
      Copy& src = t->copies[idx(Impl::source_for(*t, tier))];
      if (!src.writers.empty()) {
        if (Impl::written_by_caller(src)) {
          return make_error(ErrorCode::kInvalidArgument,
                            "tensor {}: acquiring it on the {} tier while this thread holds it "
                            "for writing on another; release that handle first",
                            t->spec.name, tier_name(tier));
        }
        s.cv.wait(lk, [&] { return src.writers.empty(); });
        continue;
      }
    }
    std::shared_ptr<Job> job = s.start_move(id, tier, MoveFor::kAcquire);
    if (!job) continue;
    s.cv.wait(lk, [&] { return job->done; });
    if (!job->status.is_ok()) return job->status;
  }
}

Status TieredTensorStore::evict(TensorId id, Tier tier) {
  Impl& s = *impl_;
  std::unique_lock lk(s.mu);
  Tensor* t = s.get(id);
  if (t == nullptr) return make_error(ErrorCode::kNotFound, "tensor {} does not exist", id);
  if (tier == t->spec.home) {
    return make_error(ErrorCode::kInvalidArgument, "tensor {}: its home ({}) cannot be evicted",
                      t->spec.name, tier_name(tier));
  }
  while (true) {
    t = s.get(id);
    Copy& c = t->copies[idx(tier)];
    if (!c.allocated) return Status::ok();
    if (c.pins > 0) {
      return make_error(ErrorCode::kInvalidArgument, "tensor {} is pinned on the {} tier",
                        t->spec.name, tier_name(tier));
    }
    if (c.busy()) {  // a move in or out of this copy: let it finish
      auto job = c.incoming;
      s.cv.wait(lk, [&] { return !c.writing_back && c.reads == 0 && (!job || job->done); });
      continue;
    }
    ZINF_RETURN_IF_ERROR(s.drop(lk, id, tier));
  }
}

std::shared_future<Status> TieredTensorStore::evict_async(TensorId id, Tier tier) {
  Impl& s = *impl_;
  return s.on_idle_copy(
      id, tier, [&s, id, tier](std::unique_lock<std::mutex>& lk) { return s.drop(lk, id, tier); });
}

std::shared_future<Status> TieredTensorStore::write_back_async(TensorId id, Tier tier) {
  Impl& s = *impl_;
  return s.on_idle_copy(id, tier, [&s, id, tier](std::unique_lock<std::mutex>& lk) {
    return s.write_back(lk, id, tier, WriteBackFor::kFlush);
  });
}

Status TieredTensorStore::discard(TensorId id, Tier tier) {
  Impl& s = *impl_;
  std::lock_guard lk(s.mu);
  Tensor* t = s.get(id);
  if (t == nullptr) return make_error(ErrorCode::kNotFound, "tensor {} does not exist", id);
  if (tier == t->spec.home) {
    return make_error(ErrorCode::kInvalidArgument, "tensor {}: its home ({}) cannot be discarded",
                      t->spec.name, tier_name(tier));
  }
  Copy& c = t->copies[idx(tier)];
  Copy& home = t->copies[idx(t->spec.home)];
  if (!c.allocated || c.busy() || home.incoming || t->creating) return Status::ok();
  for (int k = 0; k < kNumTiers; ++k) {
    if (k != idx(tier) && k != idx(t->spec.home) && t->copies[k].valid) return Status::ok();
  }
  if (!home.valid) {  // the home's older bytes now stand for the (unspecified) contents
    home.valid = true;
    ++t->version;
    ++s.stats.discards;
  }
  s.free_copy(*t, tier);
  s.cv.notify_all();
  return Status::ok();
}

Status TieredTensorStore::flush(TensorId id) {
  Impl& s = *impl_;
  std::unique_lock lk(s.mu);
  Tensor* t = s.get(id);
  if (t == nullptr) return make_error(ErrorCode::kNotFound, "tensor {} does not exist", id);
  if (t->creating) return Status::ok();  // nothing written yet: nothing to flush
  while (!t->copies[idx(t->spec.home)].valid) {
    if (!t->copies[idx(Tier::kHost)].valid && !t->copies[idx(Tier::kDevice)].valid) {
      return make_error(ErrorCode::kInternal, "tensor {} has no valid copy to flush", t->spec.name);
    }
    Tier from = t->copies[idx(Tier::kHost)].valid ? Tier::kHost : Tier::kDevice;
    Copy& c = t->copies[idx(from)];
    if (!c.writers.empty()) {  // being written: what to flush is known once the writer is done
      if (Impl::written_by_caller(c)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "tensor {}: flushing it while this thread holds it for writing on the "
                          "{} tier; release that handle first",
                          t->spec.name, tier_name(from));
      }
      s.cv.wait(lk, [&] { return c.writers.empty(); });
    } else {
      ZINF_RETURN_IF_ERROR(s.write_back(lk, id, from, WriteBackFor::kFlush));
    }
    t = s.get(id);
  }
  return Status::ok();
}

Status TieredTensorStore::flush_all() {
  size_t n = tensor_count();
  for (TensorId id = 0; id < n; ++id) {
    {
      std::lock_guard lk(impl_->mu);
      if (impl_->get(id) == nullptr) continue;
    }
    ZINF_RETURN_IF_ERROR(flush(id));
  }
  return Status::ok();
}

void TieredTensorStore::set_next_use(TensorId id, uint64_t tick) {
  std::lock_guard lk(impl_->mu);
  if (Tensor* t = impl_->get(id)) t->next_use = tick;
}

void TieredTensorStore::clear_next_use(TensorId id) { set_next_use(id, kUnknownUse); }

void TieredTensorStore::keep_for_use(TensorId id, Tier tier) {
  Impl& s = *impl_;
  std::lock_guard lk(s.mu);
  Tensor* t = s.get(id);
  if (t == nullptr || tier == t->spec.home) return;
  Copy& c = t->copies[idx(tier)];
  if (!c.valid || c.incoming) return;
  c.awaiting = true;
  c.last_use = ++s.clock;  // among copies awaiting use, the latest is taken first
}

const TensorSpec& TieredTensorStore::spec(TensorId id) const {
  std::lock_guard lk(impl_->mu);
  Tensor* t = impl_->get(id);
  ZINF_CHECK(t != nullptr, "tensor {} does not exist", id);
  return t->spec;
}

uint64_t TieredTensorStore::padded_bytes(TensorId id) const {
  std::lock_guard lk(impl_->mu);
  Tensor* t = impl_->get(id);
  return t ? t->padded : 0;
}

Residency TieredTensorStore::residency(TensorId id) const {
  std::lock_guard lk(impl_->mu);
  Residency r;
  if (Tensor* t = impl_->get(id)) {
    for (int k = 0; k < kNumTiers; ++k) {
      r.allocated[k] = t->copies[k].allocated;
      r.valid[k] = t->copies[k].valid;
      r.pins[k] = t->copies[k].pins;
    }
  }
  return r;
}

StoreStats TieredTensorStore::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->stats;
}

size_t TieredTensorStore::tensor_count() const {
  std::lock_guard lk(impl_->mu);
  return impl_->tensors.size();
}

void TieredTensorStore::unpin(const TensorHandle& h) {
  Impl& s = *impl_;
  std::lock_guard lk(s.mu);
  Tensor* t = s.get(h.id_);
  ZINF_CHECK(t != nullptr && t->copies[idx(h.tier_)].pins > 0, "unbalanced release of tensor {}",
             h.id_);
  Copy& c = t->copies[idx(h.tier_)];
  --c.pins;
  if (h.writing_) {
    auto it = std::find(c.writers.begin(), c.writers.end(), h.writer_);
    ZINF_CHECK(it != c.writers.end(), "tensor {}: a writer's handle unknown to its copy", h.id_);
    c.writers.erase(it);
  }
  c.last_use = ++s.clock;
  s.cv.notify_all();
}

void TieredTensorStore::dirty(TensorHandle& h) {
  Impl& s = *impl_;
  std::unique_lock lk(s.mu);
  Tensor* t = s.get(h.id_);
  ZINF_CHECK(t != nullptr && t->copies[idx(h.tier_)].pins > 0, "mark_dirty of unpinned tensor {}",
             h.id_);
  Copy& c = t->copies[idx(h.tier_)];
  if (!h.writing_) {
    h.writing_ = true;
    h.writer_ = std::this_thread::get_id();
    c.writers.push_back(h.writer_);
  }
  ++t->version;
  for (int k = 0; k < kNumTiers; ++k) {
    if (k != idx(h.tier_)) t->copies[k].valid = false;
  }
  c.valid = true;
  // A copy out that started after acquire() may still be reading: its result is discarded (the
  // version moved), and the writes announced here must not overlap its read.
  s.cv.wait(lk, [&] { return c.reads == 0; });
}

}  // namespace zinf
