// What the engine's parts share, one per rank: the rank's resources (the device and its streams,
// the pinned pool, the NVMe swap space, the tiered store over them), the units and the pieces of
// optimizer state, the scheduler, and the per-step counters. The parts (gatherer.h,
// grad_reducer.h, optimizer_pipeline.h, loss_scaler.h, step_agreement.h) each keep their own
// bookkeeping and touch this state as their contracts say; docs/architecture.md names them.
// How updates are scheduled is the UpdatePolicy (update_policy.h), decided once by build().
#pragma once

#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "stage_policy.h"
#include "update_policy.h"
#include "zinf/core/trace.h"
#include "zinf/engine/engine.h"
#include "zinf/io/io_engine.h"
#include "zinf/io/swap_space.h"
#include "zinf/memory/pinned_pool.h"
#include "zinf/sched/scheduler.h"

namespace zinf::engine_detail {

inline constexpr TensorId kNoTensor = ~TensorId{0};

// Waits for the operations enqueued on `stream` so far; their first failure (cleared from the
// stream, so that it is reported once).
inline Status sync(Stream& stream) {
  Status st = stream.record().wait();
  if (!st.is_ok()) (void)stream.synchronize();
  return st;
}

struct UnitState {
  zero::ShardLayout layout;
  TensorId params = kNoTensor;  // working dtype: the rank's part (StagePolicy::param_elements)
  std::vector<size_t> pieces;   // its optimizer state, in range order (indices into `pieces`)
  // The accumulators hold zeros in this rank's range (without their bytes having been written:
  // zeroing is lazy, so an offloaded accumulator is not read and written just to clear it).
  bool acc_zero = true;
  Tier opt_home = Tier::kDevice;  // the optimizer's home for this unit (partial offload)
  // Sharded parameters, units of at most stage3_param_persistence_threshold elements: once
  // gathered in a step they stay gathered until the update.
  bool persistent = false;
  int scopes = 0;  // open scopes on the unit
  // Gatherer (sharded parameters): the gathered full parameters while the unit is live (in use,
  // fetched ahead or kept); the all-gather filling them may still be in flight, its shard pinned
  // until done. With one rank the shard is the whole unit: `shard_view` holds its device copy
  // instead, with nothing copied and nothing in flight.
  DeviceBuffer gathered;
  TensorHandle gathering_shard;
  TensorHandle shard_view;
  bool live() const { return gathered || shard_view; }
  void* gathered_data() const { return gathered ? gathered.data() : shard_view.data(); }
  std::vector<Device::CommWindow> gather_windows;  // the all-gather's reach into the device
  comm::Work gather_work;
  bool gather_in_flight = false;
  trace::Clock::time_point gather_issued;
  bool used_since_gather = false;  // for the schedule report
  // The unit's gradients are final for this step (its last use in the recorded order has been
  // reduced; known only while the step follows the trace).
  bool grads_final = false;
  // Fused updates: its final reduction of the step was issued and its update goes to the
  // optimizer worker once the reduction completes; the unit must not be used again this step.
  bool final_issued = false;
};

// A piece of one unit's optimizer state: the flat elements [begin, end) of the unit.
struct PieceState {
  size_t unit = 0;
  uint64_t begin = 0, end = 0;
  TensorId master = kNoTensor;            // fp32 master when mixed
  TensorId m = kNoTensor, v = kNoTensor;  // fp32 Adam moments
  // The fp32 gradient accumulator holding [begin, end): the piece's own, or (a full accumulator,
  // StagePolicy::full_grad_accumulator) the unit's one, shared by its pieces.
  TensorId acc = kNoTensor;
  uint64_t acc_base = 0;  // flat index of the accumulator's element 0
  bool owns_acc = true;   // false for a shared accumulator
};

// Closes each window (what the collectives wrote reaches the device) and empties the list; the
// first failure.
inline Status close_windows(std::vector<Device::CommWindow>& windows) {
  Status first;
  for (Device::CommWindow& w : windows) {
    Status s = w.close();
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
  }
  windows.clear();
  return first;
}

struct EngineState {
  EngineState(const EngineSettings& settings, comm::Communicator& c)
      : s(settings), comm(c), policy(StagePolicy::for_stage(settings.stage)) {}

  EngineSettings s;  // effective: automatic budgets resolved by build()
  comm::Communicator& comm;
  StagePolicy policy;  // what the stage partitions (the only reader of s.stage)
  std::vector<zero::UnitSpec> units;
  InitFn init;
  int rank = 0, world = 1;
  bool mixed = false;  // working dtype is not fp32: a separate fp32 master exists

  Ledger ledger;
  Budgets budgets;             // how device_mem and host_mem were chosen
  StateSizes sizes;            // what the budgets were chosen from
  uint64_t staging_total = 0;  // the store's staging buffers, taken from the host budget
  // Gradient reductions left in flight across scopes (overlap_comm: 2, fewer when the device
  // budget holds fewer gradient buffers; budgets.h reductions_that_fit).
  int max_reductions_in_flight = 2;
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<Device> device;
  // The engine's device operations, in order: `stream` for the gathering, reduction and norm
  // path (the calling thread), `optimizer_stream` for updates (step(), or the optimizer worker
  // under overlap_optimizer; never both at once).
  std::unique_ptr<Stream> stream, optimizer_stream;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<TieredTensorStore> store;

  std::vector<UnitState> unit_states;
  std::vector<PieceState> pieces;
  std::unique_ptr<sched::Scheduler> sched;

  int64_t steps = 0;               // committed optimizer steps
  bool update_incomplete = false;  // the last step() failed: the next call must finish it
  // A failure the engine cannot go on from (a non-finite gradient met by updates fused into the
  // backward pass): every later step() and gather returns it.
  Status fatal;
  UpdatePolicy updates;  // how updates are scheduled against the passes (decided by build())
  Status sticky;         // an error from a scope's destructor, reported by the next call

  // A window through which the communicator reaches [data, data + bytes) of device memory
  // (Device::comm_window): a host-side communicator works at the window's data(); NCCL reaches
  // device memory itself and is given the range as it is.
  Device::CommWindow comm_window(void* data, uint64_t bytes, Device::WindowAccess access) {
    if (comm.backend() == comm::Backend::kNccl) return Device::CommWindow(data);
    return device->comm_window(data, bytes, access);
  }
  CommReport comm_now;          // counts since the last step
  ScheduleReport schedule_now;  // counts since the last step
  // The store's counters at the end of each step's update (Engine::update_ends()).
  std::deque<Engine::UpdateEnd> update_ends;
  uint64_t update_end_count = 0;
  void record_update_end(const StoreStats& stats, std::chrono::steady_clock::time_point at) {
    update_ends.push_back({.index = ++update_end_count, .stats = stats, .at = at});
    if (update_ends.size() > 8) update_ends.pop_front();
  }

  // "rank<r> <what>": this rank's track in a trace.
  std::string track(const char* what) const {
    return *what ? fmt::format("rank{} {}", rank, what) : fmt::format("rank{}", rank);
  }
  // Where a unit's optimizer update runs: on the device, or on the CPU for state offloaded to
  // host memory or NVMe.
  static Tier compute_tier(const UnitState& st) {
    return st.opt_home == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  }
  // Index of flat element `flat` in the unit's parameter tensor.
  uint64_t param_index(const UnitState& u, uint64_t flat) const {
    return policy.param_index(u.layout, rank, flat);
  }
  Result<TensorId> make_tensor(const std::string& name, uint64_t bytes, Tier home,
                               MemoryCategory category) {
    return store->create_tensor(
        TensorSpec{.name = name, .bytes = bytes, .home = home, .category = category});
  }

  // Offloaded state does not stay above its home once used: write it back and drop the copy
  // (asynchronously; finish_evictions() waits and reports the first failure).
  void release_offloaded(TensorId id, Tier home, Tier where) {
    if (home == Tier::kNvme || (home == Tier::kHost && where == Tier::kDevice)) {
      auto f = store->evict_async(id, where);
      std::lock_guard lk(evictions_mu_);
      evictions_.push_back(std::move(f));
    }
  }
  // Writes the copy in `where` back to its home, keeping it (clean) for a use soon (on the store's
  // movers; finish_evictions() reports a failure).
  void write_back_offloaded(TensorId id, Tier where) {
    auto f = store->write_back_async(id, where);
    std::lock_guard lk(evictions_mu_);
    evictions_.push_back(std::move(f));
  }
  // The tensor's contents are dead (a gradient accumulator after its update): its copy in
  // `where` goes without a write-back to its home.
  Status discard_offloaded(TensorId id, Tier home, Tier where) {
    if (home == where) return Status::ok();
    return store->discard(id, where);
  }
  Status finish_evictions() {
    std::vector<std::shared_future<Status>> mine;
    {
      std::lock_guard lk(evictions_mu_);
      mine.swap(evictions_);
    }
    Status first;
    for (auto& f : mine) {
      Status st = f.get();
      if (first.is_ok() && !st.is_ok()) first = std::move(st);
    }
    return first;
  }

 private:
  std::mutex evictions_mu_;
  std::vector<std::shared_future<Status>> evictions_;  // write-backs in flight
};

}  // namespace zinf::engine_detail
