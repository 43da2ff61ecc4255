#include "optimizer_pipeline.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include "zinf/core/log.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::engine_detail {

// Runs optimizer updates on one thread of its own, in submission order (overlap_optimizer).
class OptimizerWorker {
 public:
  OptimizerWorker() : thread_([this] { run(); }) {}
  ~OptimizerWorker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void submit(std::function<Status()> job) {
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  // Waits until every submitted job has run; the first failure since the last wait.
  Status wait() {
    std::unique_lock lk(mu_);
    idle_cv_.wait(lk, [&] { return jobs_.empty() && !busy_; });
    return std::exchange(first_error_, Status());
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lk.unlock();
      Status st = job();
      lk.lock();
      busy_ = false;
      if (!st.is_ok() && first_error_.is_ok()) first_error_ = std::move(st);
      if (jobs_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> jobs_;
  bool busy_ = false, stop_ = false;
  Status first_error_;
  std::thread thread_;
};

OptimizerPipeline::OptimizerPipeline(EngineState& e, const LossScaler& scaler)
    : e_(e), scaler_(scaler) {
  e_.updates_early = updates_early();
  if (e_.s.overlap_optimizer) {
    worker_ = std::make_unique<OptimizerWorker>();
    if (!updates_early()) {
      log::warn_once("engine:overlap-optimizer",
                     "overlap_optimizer has no effect with gradient clipping or fp16: the "
                     "update needs every gradient (the global norm, the overflow check) first");
    } else {
      log::info(
          "overlap_optimizer: updates start before the global gradient norm is known, so a "
          "non-finite gradient met after the step's first update cannot skip the step: it stops "
          "the run instead (with one rank, one met by the first update skips the step)");
    }
  }
}

OptimizerPipeline::~OptimizerPipeline() = default;

uint64_t OptimizerPipeline::sub_group_limit() const {
  const uint64_t limit = e_.s.sub_group_elements;
  if (limit == 0 || e_.s.optimizer_home == Tier::kDevice) return limit;
  // Per element of a group: fp32 master (mixed), m, v and gradient accumulator. A unit's
  // parameter tensor is acquired whole for its pieces' updates: the two it holds (the one being
  // updated, the next read ahead: StateSizes::cpu_update_bytes) and the staging buffers come off
  // the budget first.
  const uint64_t bytes_per_element = e_.mixed ? 16 : 12;
  const uint64_t reserved = e_.staging_total + e_.sizes.cpu_update_bytes;
  const uint64_t fit =
      (e_.s.host_mem - std::min(e_.s.host_mem, reserved)) / (3 * bytes_per_element);
  return std::min(limit, std::max(fit / kernels::kSumSquaresBlockElems, uint64_t{1}) *
                             kernels::kSumSquaresBlockElems);
}

void OptimizerPipeline::set_plan(const sched::SubGroupPlan& plan, uint64_t accumulator_bytes) {
  groups_ = plan.groups;
  updated_.assign(plan.pieces.size(), 0);
  sums_.assign(plan.pieces.size(), Sums{});
  walk_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) walk_.push_back(g);
  rank_walk();
  // Bytes a group's read-ahead brings into the host budget: m, v and the fp32 master (mixed) of
  // its pieces unless they live there, and the whole parameter tensor of each of its units
  // unless homed there (update_piece() acquires the unit's tensor) or left on the device between
  // passes (the walk takes it from there: read_ahead() does not ask for it).
  const uint64_t state_per_element = e_.s.optimizer_home == Tier::kHost ? 0 : (e_.mixed ? 12 : 8);
  const bool params_read =
      e_.policy.sharded_params && e_.s.param_home != Tier::kHost && !params_stay_on_device();
  uint64_t largest_read = 0, all_params = 0;
  group_state_bytes_.assign(groups_.size(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    uint64_t bytes = 0;
    size_t last_unit = SIZE_MAX;
    for (size_t pi : groups_[g]) {
      const sched::Piece& piece = plan.pieces[pi];
      group_state_bytes_[g] += piece.range.size() * state_per_element;
      if (params_read && piece.unit != last_unit) {  // (a group's pieces are consecutive)
        const uint64_t pb =
            e_.policy.param_elements(e_.unit_states[piece.unit].layout) * dtype_size(e_.s.dtype);
        bytes += pb;
        all_params += pb;
      }
      last_unit = piece.unit;
    }
    bytes += group_state_bytes_[g];
    largest_read = std::max(largest_read, bytes);
  }
  // What the host budget holds anyway by the end of the backward pass: the state homed there
  // (with its accumulators), the accumulators of state homed on NVMe, the staging buffers.
  const uint64_t held = e_.sizes.host_home_bytes +
                        (e_.s.optimizer_home == Tier::kHost ? 0 : accumulator_bytes) +
                        e_.staging_total;
  // As many groups as fit beside that, each counted as the largest: the state the backward pass
  // reads ahead is then not evicted by the accumulators it fills afterwards (which would read it
  // twice). Parameters left on the device come back to the host at the walk's start, two at a
  // time, into room taken off here too (or the walk's first copies evict the last group read).
  const uint64_t ahead_held = held + (params_stay_on_device() ? e_.sizes.cpu_update_bytes : 0);
  groups_read_during_backward_ =
      e_.s.pipeline_read && largest_read > 0 && ahead_held < e_.s.host_mem
          ? (e_.s.host_mem - ahead_held) / largest_read
          : 0;
  // Behind step() the walk keeps every unit's parameters for the next forward pass; the state it
  // may keep besides for the next walk (Keep::state_ranks) is what fits beside those and the
  // above. When the parameters stay on the device between passes (params_stay_on_device()),
  // their host copies are clean once gathered and give way: only the two the walk works on
  // count.
  const uint64_t params_held = params_stay_on_device() ? e_.sizes.cpu_update_bytes : all_params;
  const uint64_t held_with_params = held + params_held;
  state_room_ = held_with_params < e_.s.host_mem ? e_.s.host_mem - held_with_params : 0;
  // By the walk's end every accumulator is spent: the state of its last groups may stay dirty
  // until the next backward pass (write_behind()) in the room left beside the kept state (taken
  // off in write_behind_from()), the parameters as above and the next group's reads.
  largest_state_ = group_state_bytes_.empty()
                       ? 0
                       : *std::max_element(group_state_bytes_.begin(), group_state_bytes_.end());
  uint64_t beside = params_held + e_.sizes.host_home_bytes + e_.staging_total + largest_state_;
  if (updates_early()) {
    // Fused into the backward pass, the last units' state stays dirty while the pass goes on, to
    // be written under the next forward pass. Beside it, the units still to be updated hold two
    // parameter copies (cpu_update_bytes), the accumulator being updated and the one being
    // filled, and two groups' state (the one updated, the next read). Only with the shards left
    // on the device: otherwise the next forward pass reads every shard from NVMe, and writes
    // under it would hold those reads up (no room: write_behind_from() is past the walk).
    beside = params_stay_on_device()
                 ? e_.sizes.cpu_update_bytes + 2 * e_.sizes.largest_unit_elements * 4 +
                       e_.sizes.host_home_bytes + e_.staging_total + 2 * largest_state_
                 : e_.s.host_mem;
  }
  write_behind_room_ = beside < e_.s.host_mem ? e_.s.host_mem - beside : 0;
}

float OptimizerPipeline::combined_scale() const {
  return static_cast<float>(
      1.0 / (static_cast<double>(e_.s.gradient_accumulation_steps) * scaler_.scale()));
}

bool OptimizerPipeline::updates_early() const {
  return e_.s.overlap_optimizer && e_.s.gradient_clipping <= 0 && !scaler_.checks_overflow();
}

void OptimizerPipeline::on_grads_final(size_t u) {
  UnitState& st = e_.unit_states[u];
  st.grads_final = true;
  if (!updates_early()) write_behind();  // (fused into this pass: after_commit())
  if (st.final_issued) {
    start_early_update(u);
  } else if (groups_read_during_backward_ > 0) {
    read_ahead();
  }
}

Status OptimizerPipeline::wait_early() { return worker_ ? worker_->wait() : Status::ok(); }

size_t OptimizerPipeline::take_units_updated_early() { return std::exchange(updated_early_, 0); }

std::optional<size_t> OptimizerPipeline::take_nonfinite_before_any_update() {
  pieces_updated_early_ = 0;
  return std::exchange(nonfinite_before_any_update_, std::nullopt);
}

void OptimizerPipeline::plan_walk() {
  walk_prefetched_ = 0;
  for (UnitState& st : e_.unit_states) st.grads_final = false;
  if (!e_.sched->following()) return;  // keep the order of the last recorded trace
  const auto& trace = e_.sched->trace();
  // A unit the trace never uses gets no final gradient in a step: its groups go last.
  std::vector<size_t> last_use(e_.unit_states.size(), trace.size());
  for (size_t i = 0; i < trace.size(); ++i) last_use[trace[i]] = i;
  std::vector<size_t> ready(groups_.size(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t pi : groups_[g]) ready[g] = std::max(ready[g], last_use[e_.pieces[pi].unit]);
  }
  std::stable_sort(walk_.begin(), walk_.end(),
                   [&](size_t a, size_t b) { return ready[a] < ready[b]; });
  first_use_.assign(e_.unit_states.size(), trace.size());
  for (size_t i = trace.size(); i-- > 0;) first_use_[trace[i]] = i;
  if (updates_behind()) {
    // Behind step(), in the order of the units' first use: the next forward pass follows the
    // walk unit by unit (and the backward pass reads its first groups ahead: read_ahead()).
    auto key = [&](size_t g) {
      size_t k = trace.size();
      for (size_t pi : groups_[g]) k = std::min(k, first_use_[e_.pieces[pi].unit]);
      return k;
    };
    std::stable_sort(walk_.begin(), walk_.end(),
                     [&](size_t a, size_t b) { return key(a) < key(b); });
  }
  rank_walk();
}

void OptimizerPipeline::rank_walk() {
  walk_rank_.assign(e_.pieces.size(), 0);
  for (size_t r = 0; r < walk_.size(); ++r) {
    for (size_t pi : groups_[walk_[r]]) walk_rank_[pi] = r;
  }
}

Status OptimizerPipeline::zero(const TensorHandle& h) {
  if (h.tier() == Tier::kDevice) {
    e_.device->fill({.data = h.data(), .dtype = DType::kF32, .numel = h.bytes() / 4}, 0.0f,
                    *e_.stream);
    return sync(*e_.stream);
  }
  std::memset(h.data(), 0, h.bytes());
  return Status::ok();
}

Status OptimizerPipeline::zero_untouched_accumulators() {
  for (UnitState& st : e_.unit_states) {
    if (!st.acc_zero) continue;
    for (size_t pi : st.pieces) {
      const PieceState& p = e_.pieces[pi];
      if (!p.owns_acc && pi != st.pieces.front()) continue;  // a shared one: once
      ZINF_ASSIGN_OR_RETURN(
          TensorHandle acc,
          e_.store->acquire(p.acc, EngineState::compute_tier(st), Access::kOverwrite));
      ZINF_RETURN_IF_ERROR(zero(acc));
      acc.mark_dirty();
    }
    for (size_t pi : st.pieces) forget_sums(pi);  // sums from before a checkpoint load
    st.acc_zero = false;
  }
  return Status::ok();
}

// The 1024-element block sums of squares of piece `p`'s gradient, `acc` holding it.
static Status piece_block_sums(EngineState& e, Stream& stream, const PieceState& p,
                               const TensorHandle& acc, uint64_t acc_base, float scale_factor,
                               std::vector<double>& blocks) {
  const uint64_t n = p.end - p.begin;
  blocks.resize(kernels::sum_squares_block_count(n));
  const float* grads = static_cast<const float*>(acc.data()) + (p.begin - acc_base);
  if (acc.tier() == Tier::kDevice) {
    e.device->sum_squares_blocks({grads, DType::kF32, n}, scale_factor, blocks.data(), stream);
    return sync(stream);
  }
  kernels::grad_sum_squares_blocks(grads, DType::kF32, n, scale_factor, blocks.data(),
                                   e.s.optimizer_threads);
  return Status::ok();
}

Status OptimizerPipeline::record_sums(size_t pi, const TensorHandle& acc, uint64_t acc_base,
                                      Stream& stream) {
  Sums& s = sums_[pi];
  s.valid = false;
  if (updates_early()) return Status::ok();  // no norm is taken
  // The accumulator's next use is the update walk, after this step's trace, in walk order: when
  // the host budget cannot keep every accumulator until then, the ones used last are written
  // out (farthest next use), and the walk starts with its first accumulators in memory, whose
  // room it gets back as it goes.
  if (pi < walk_rank_.size() && e_.sched->following()) {
    const uint64_t trace = e_.sched->trace().size();
    e_.store->set_next_use(e_.pieces[pi].acc,
                           (static_cast<uint64_t>(e_.steps) + 1) * trace + walk_rank_[pi]);
  }
  s.factor = combined_scale();
  ZINF_RETURN_IF_ERROR(
      piece_block_sums(e_, stream, e_.pieces[pi], acc, acc_base, s.factor, s.blocks));
  s.valid = true;
  return Status::ok();
}

Result<double> OptimizerPipeline::partial_sum_squares(int range_rank, float scale_factor) {
  std::vector<size_t> selected;
  for (const UnitState& st : e_.unit_states) {
    const uint64_t lo = st.layout.shard_begin(range_rank), hi = st.layout.shard_end(range_rank);
    for (size_t pi : st.pieces) {
      if (e_.pieces[pi].begin >= lo && e_.pieces[pi].end <= hi) selected.push_back(pi);
    }
  }
  // Sums recorded when the gradient became final give the same blocks, added in the same order.
  auto recorded = [&](size_t pi) {
    return sums_[pi].valid && sums_[pi].factor == scale_factor &&
           !e_.unit_states[e_.pieces[pi].unit].acc_zero;
  };
  std::vector<size_t> to_read;  // the accumulators that must be read, in order
  for (size_t pi : selected) {
    if (!recorded(pi)) to_read.push_back(pi);
  }
  double total = 0;
  std::vector<double> blocks;
  size_t next_read = 0;
  for (size_t pi : selected) {
    if (recorded(pi)) {
      for (double b : sums_[pi].blocks) total += b;
      continue;
    }
    ++next_read;
    if (next_read < to_read.size()) {  // read the next accumulator while this one is summed
      const PieceState& next = e_.pieces[to_read[next_read]];
      e_.store->prefetch(next.acc, EngineState::compute_tier(e_.unit_states[next.unit]));
    }
    const PieceState& p = e_.pieces[pi];
    ZINF_ASSIGN_OR_RETURN(
        TensorHandle acc,
        e_.store->acquire(p.acc, EngineState::compute_tier(e_.unit_states[p.unit])));
    ZINF_RETURN_IF_ERROR(
        piece_block_sums(e_, *e_.stream, p, acc, p.acc_base, scale_factor, blocks));
    for (double b : blocks) total += b;
  }
  return total;
}

std::vector<std::vector<size_t>> OptimizerPipeline::pieces_to_update() const {
  std::vector<std::vector<size_t>> todo;
  for (size_t g : walk_) {
    todo.emplace_back();
    for (size_t pi : groups_[g]) {
      if (!updated_[pi]) todo.back().push_back(pi);
    }
    if (todo.back().empty()) todo.pop_back();
  }
  return todo;
}

Status OptimizerPipeline::update(const kernels::AdamStepArgs& args, Status& writeback) {
  return walk(pieces_to_update(), args, e_.s.adam, writeback);
}

Status OptimizerPipeline::walk(const std::vector<std::vector<size_t>>& todo,
                               const kernels::AdamStepArgs& args, const kernels::AdamConfig& adam,
                               Status& writeback, const std::function<void(size_t)>& done,
                               const Keep& keep) {
  // Before each piece is updated, the reads of the rest of its group and of the next group are
  // asked for, in the order of the walk, into the room there is: clean copies only are evicted
  // for them (the accumulators still to be used stay, and nothing read ahead goes), and they stop
  // at the first that does not fit, so a later one never takes the room an earlier one needs.
  // Asked again before the next piece, once the pieces before it are written back and freed;
  // what is still missing when its piece comes is read on demand. When the walk ends (or fails)
  // the last list stops: whatever it still has to read is done with.
  struct StopReads {
    TieredTensorStore& store;
    ~StopReads() { store.prefetch_in_order({}, PrefetchRoom::kCleanOnly); }
  } stop_reads{*e_.store};
  for (size_t g = 0; g < todo.size(); ++g) {
    for (size_t k = 0; k < todo[g].size(); ++k) {
      if (e_.s.pipeline_read) {
        std::vector<std::pair<TensorId, Tier>> reads;
        for (size_t j = k; j < todo[g].size(); ++j) append_reads(todo[g][j], reads);
        if (g + 1 < todo.size()) {
          for (size_t pi : todo[g + 1]) append_reads(pi, reads);
        }
        e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
      }
      ZINF_RETURN_IF_ERROR(update_piece(todo[g][k], args, adam, keep));
      if (done) done(todo[g][k]);
    }
    if (!e_.s.pipeline_write) {
      Status wb = e_.finish_evictions();
      if (writeback.is_ok()) writeback = std::move(wb);
    }
  }
  return Status::ok();
}

bool OptimizerPipeline::updates_behind() const {
  return e_.s.update_behind && e_.world == 1 && e_.policy.sharded_params && !updates_early() &&
         e_.s.optimizer_home != Tier::kDevice;
}

bool OptimizerPipeline::params_stay_on_device() const {
  return e_.device_holds_all_params && (updates_behind() || updates_early());
}

uint64_t OptimizerPipeline::next_walk_tick(size_t u) const {
  const uint64_t trace = e_.sched->trace().size();
  const uint64_t next = static_cast<uint64_t>(e_.steps + 1) * trace;
  return u < first_use_.size() ? next + first_use_[u] : next + trace;
}

size_t OptimizerPipeline::state_ranks_that_fit() const {
  uint64_t used = 0;
  size_t r = 0;
  for (; r < walk_.size(); ++r) {
    used += group_state_bytes_[walk_[r]];
    if (used > state_room_) break;
  }
  return r;
}

size_t OptimizerPipeline::write_behind_from(size_t state_ranks) const {
  uint64_t kept = 0;
  for (size_t r = 0; r < std::min(state_ranks, walk_.size()); ++r) {
    kept += group_state_bytes_[walk_[r]];
  }
  if (kept >= write_behind_room_) return walk_.size();
  uint64_t left = 0;
  size_t r = walk_.size();
  while (r > state_ranks && left + group_state_bytes_[walk_[r - 1]] <= write_behind_room_ - kept) {
    left += group_state_bytes_[walk_[--r]];
  }
  return r;
}

void OptimizerPipeline::write_behind() {
  std::vector<TensorId> left;
  {
    std::lock_guard lk(write_behind_mu_);
    left.swap(write_behind_);
  }
  // Filled in walk order (start_behind() empties it before a walk): the last groups first.
  for (auto it = left.rbegin(); it != left.rend(); ++it) e_.write_back_offloaded(*it, Tier::kHost);
}

void OptimizerPipeline::start_behind(const kernels::AdamStepArgs& args) {
  if (!worker_) worker_ = std::make_unique<OptimizerWorker>();
  write_behind();  // what the last walk left, when no backward pass came since
  // In plan_walk()'s order. The parameters are kept for the next forward pass (at that step's
  // ticks: Gatherer::plan_ahead's, once this step is committed) when the step followed the trace
  // (its uses are then known) and the host budget has room beyond every accumulator (it reads
  // groups ahead during the backward pass). Without that room the walk needs it for its own
  // reads: kept copies then made the 2 B-shaped walk twice as slow (docs/offload.md), and the
  // pass finds most shards still there all the same, since it follows the walk closely. Shards
  // left on the device between passes are kept whatever the room: the pass's gather makes the
  // host copy clean (the device's is as new), so it gives way without being written.
  Keep keep;
  if ((groups_read_during_backward_ > 0 || params_stay_on_device()) && e_.sched->following() &&
      first_use_.size() == e_.unit_states.size()) {
    const uint64_t trace = e_.sched->trace().size();
    keep = {.params = true,
            .tick = static_cast<uint64_t>(e_.steps + 1) * trace,
            .state_ranks = state_ranks_that_fit(),
            .state_tick = static_cast<uint64_t>(e_.steps + 2) * trace};
    keep.write_behind_from = write_behind_from(keep.state_ranks);
  }
  std::vector<std::vector<size_t>> todo;
  std::vector<size_t> left(e_.unit_states.size(), 0);
  for (size_t g : walk_) {
    todo.emplace_back();
    for (size_t pi : groups_[g]) {
      if (updated_[pi]) continue;
      todo.back().push_back(pi);
      ++left[e_.pieces[pi].unit];
    }
    if (todo.back().empty()) todo.pop_back();
  }
  {
    std::lock_guard lk(behind_.mu);
    behind_.running = true;
    behind_.left = std::move(left);
    behind_.status = Status();
    behind_.writeback = Status();
  }
  behind_.pending = true;
  behind_.failed = false;
  behind_.args = args;
  behind_.adam = e_.s.adam;
  worker_->submit([this, todo = std::move(todo), args, adam = e_.s.adam, keep]() -> Status {
    Status writeback;
    // A unit done is as after a committed step: its accumulators start again from zero and its
    // recorded sums are spent. The next pass's uses of the unit wait for this (wait_unit).
    Status st = walk(
        todo, args, adam, writeback,
        [this](size_t pi) {
          const size_t u = e_.pieces[pi].unit;
          std::lock_guard lk(behind_.mu);
          if (--behind_.left[u] > 0) return;
          e_.unit_states[u].acc_zero = true;
          for (size_t q : e_.unit_states[u].pieces) sums_[q].valid = false;
          behind_.cv.notify_all();
        },
        keep);
    Status wb = e_.finish_evictions();
    if (writeback.is_ok()) writeback = std::move(wb);
    {
      std::lock_guard lk(behind_.mu);
      behind_.end_stats = e_.store->stats();
      behind_.end_at = std::chrono::steady_clock::now();
      behind_.running = false;
      behind_.status = std::move(st);
      behind_.writeback = std::move(writeback);
    }
    behind_.cv.notify_all();
    return Status::ok();  // reported through behind_ (wait_unit, wait_behind)
  });
}

bool OptimizerPipeline::unit_ready(size_t u) {
  if (!behind_.pending) return true;
  std::lock_guard lk(behind_.mu);
  return behind_.left[u] == 0;
}

Status OptimizerPipeline::wait_unit(size_t u) {
  if (!behind_.pending) return Status::ok();
  std::unique_lock lk(behind_.mu);
  behind_.cv.wait(lk, [&] { return behind_.left[u] == 0 || !behind_.running; });
  if (behind_.left[u] == 0) return Status::ok();
  return behind_.status.is_ok()
             ? make_error(ErrorCode::kInternal,
                          "unit {}: the update walk ended without updating it", e_.units[u].name)
             : behind_.status;
}

Status OptimizerPipeline::wait_behind() {
  if (!behind_.pending) return Status::ok();
  Status st;
  {
    std::unique_lock lk(behind_.mu);
    behind_.cv.wait(lk, [&] { return !behind_.running; });
    st = behind_.status;
    e_.record_update_end(behind_.end_stats, behind_.end_at);
  }
  behind_.pending = false;
  if (!st.is_ok()) {
    behind_.failed = true;
    return st;
  }
  std::fill(updated_.begin(), updated_.end(), 0);
  return Status::ok();
}

Status OptimizerPipeline::finish_behind(Status& writeback) {
  ZINF_RETURN_IF_ERROR(walk(pieces_to_update(), behind_.args, behind_.adam, writeback));
  behind_.failed = false;
  return Status::ok();
}

void OptimizerPipeline::commit() {
  // Behind step(), the walk clears each unit as it updates it, and wait_behind() the rest.
  if (behind_.pending) return;
  std::fill(updated_.begin(), updated_.end(), 0);
  discard();
}

void OptimizerPipeline::after_commit() {
  if (!updates_early()) return;
  write_behind();
  // The next pass's first updates need their state as soon as its backward pass begins: read
  // under the forward pass, which moves nothing else when the shards stay on the device, as far
  // as two of the largest groups (the room the pass's updates need anyway), clean copies only
  // giving way.
  if (!e_.s.pipeline_read || !params_stay_on_device() || !e_.sched->following() ||
      largest_state_ == 0) {
    return;
  }
  std::vector<std::pair<TensorId, Tier>> reads;
  uint64_t bytes = 0;
  for (size_t r = 0; r < walk_.size(); ++r) {
    bytes += group_state_bytes_[walk_[r]];
    if (bytes > 2 * largest_state_) break;
    for (size_t pi : groups_[walk_[r]]) append_reads(pi, reads, /*with_params=*/false);
  }
  if (!reads.empty()) e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
}

// After a step the accumulators are zero; the bytes are written only when needed.
void OptimizerPipeline::discard() {
  for (UnitState& st : e_.unit_states) st.acc_zero = true;
  for (Sums& s : sums_) s.valid = false;
}

// One ordered list on one mover, in walk order, for every group whose gradients are final so far
// (behind step(): from the first) up to the number that fits: the other mover stays free for the
// reads the backward pass waits for, and a list that stopped for want of room is taken up again by
// the next call, once the backward pass has freed some (a newer list supersedes the older).
void OptimizerPipeline::read_ahead() {
  auto final = [&](size_t r) {
    return std::all_of(groups_[walk_[r]].begin(), groups_[walk_[r]].end(),
                       [&](size_t pi) { return e_.unit_states[e_.pieces[pi].unit].grads_final; });
  };
  const size_t limit = std::min(groups_read_during_backward_, walk_.size());
  // Behind step() the walk goes in the forward order, whose first units' gradients are final
  // last: their state (which needs no gradient) is read from the backward pass's start.
  while (walk_prefetched_ < limit && (updates_behind() || final(walk_prefetched_))) {
    ++walk_prefetched_;
  }
  if (walk_prefetched_ == 0) return;
  // Parameters that stay on the device come back to the host at the walk: the pass is using them.
  const bool with_params = !params_stay_on_device();
  std::vector<std::pair<TensorId, Tier>> reads;
  for (size_t r = 0; r < walk_prefetched_; ++r) {
    for (size_t pi : groups_[walk_[r]]) append_reads(pi, reads, with_params);
  }
  e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
}

// A group holding pieces of u and of other units is then updated partly early and partly in
// step(), which skips what was done.
void OptimizerPipeline::start_early_update(size_t u) {
  ++updated_early_;
  const kernels::AdamStepArgs args{.step = e_.steps + 1, .grad_scale = combined_scale()};
  std::vector<size_t> mine = e_.unit_states[u].pieces;
  // The state of the step's last updates is written under the next forward pass (commit() starts
  // it), when the disk is otherwise idle, rather than under this backward pass.
  Keep keep;
  if (e_.sched->following()) {
    keep.tick = next_walk_tick(u);  // the refreshed device copy's next use (taken on this thread)
    keep.state_tick = static_cast<uint64_t>(e_.steps + 2) * e_.sched->trace().size();
    keep.write_behind_from = write_behind_from(0);
  }
  // The walk's group after u's: the next unit's update needs its state as soon as that unit's
  // gradients are final, so it is read while u is updated (its parameters and accumulator are
  // still in the pass's use). Only with the shards left on the device: otherwise the host budget
  // also holds each unit's shard for its update, and a read this early may be evicted unused.
  std::vector<size_t> next;
  if (e_.s.pipeline_read && params_stay_on_device() && !mine.empty() && e_.sched->following()) {
    size_t last = 0;
    for (size_t pi : mine) last = std::max(last, walk_rank_[pi]);
    if (last + 1 < walk_.size()) next = groups_[walk_[last + 1]];
  }
  worker_->submit([this, mine, next, args, adam = e_.s.adam, keep]() -> Status {
    for (size_t k = 0; k < mine.size(); ++k) {
      if (e_.s.pipeline_read) {  // this piece (the first time) and the next one
        if (k == 0) prefetch_piece(mine[0]);
        if (k + 1 < mine.size()) prefetch_piece(mine[k + 1]);
        if (k == 0) {
          for (size_t pi : next) prefetch_state(pi, PrefetchRoom::kCleanOnly);
        }
      }
      ZINF_RETURN_IF_ERROR(update_piece(mine[k], args, adam, keep));
    }
    return Status::ok();
  });
}

// Adam over one piece: its state and the unit's parameters where the update runs.
Status OptimizerPipeline::update_piece(size_t pi, const kernels::AdamStepArgs& args,
                                       const kernels::AdamConfig& adam, const Keep& keep) {
  const PieceState& p = e_.pieces[pi];
  UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  const bool mixed = e_.mixed;
  if (updates_early() && nonfinite_before_any_update_) {
    // The step is skipped (see below): its gradient is dead, and nothing is updated.
    return e_.discard_offloaded(p.acc, st.opt_home, tier);
  }
  ZINF_ASSIGN_OR_RETURN(TensorHandle params, e_.store->acquire(st.params, tier));
  TensorHandle master;
  if (mixed) {
    ZINF_ASSIGN_OR_RETURN(master, e_.store->acquire(p.master, tier));
  }
  ZINF_ASSIGN_OR_RETURN(TensorHandle m, e_.store->acquire(p.m, tier));
  ZINF_ASSIGN_OR_RETURN(TensorHandle v, e_.store->acquire(p.v, tier));
  ZINF_ASSIGN_OR_RETURN(TensorHandle acc, e_.store->acquire(p.acc, tier));
  const uint64_t wsize = dtype_size(e_.s.dtype);
  if (updates_early()) {
    // Fused into the backward pass, before any global check: a non-finite gradient must not
    // reach the state. Units updated earlier in this step cannot be taken back, so the step
    // fails on every rank and the run stops (step() makes it fatal).
    const uint64_t n = p.end - p.begin;
    float* grads = static_cast<float*>(acc.data()) + (p.begin - p.acc_base);
    bool bad = false;
    if (tier == Tier::kDevice) {
      e_.device->scale({.data = grads, .dtype = DType::kF32, .numel = n}, 1.0f, &bad,
                       *e_.optimizer_stream);
      ZINF_RETURN_IF_ERROR(sync(*e_.optimizer_stream));
    } else {
      bad = kernels::grad_has_nonfinite(grads, DType::kF32, n, e_.s.optimizer_threads);
    }
    if (bad && e_.world == 1 && pieces_updated_early_ == 0) {
      // Met by the step's first update (a non-finite loss makes the first gradient so): nothing
      // has reached the state yet, so the step is skipped as without overlap_optimizer (step()
      // sees take_nonfinite_before_any_update()); the updates after it do nothing. With several
      // ranks another rank may have updated its first unit already: that case stops below.
      nonfinite_before_any_update_ = p.unit;
      acc.release();
      return e_.discard_offloaded(p.acc, st.opt_home, tier);
    }
    if (bad) {
      return make_error(ErrorCode::kNonFinite,
                        "unit {}: a non-finite gradient (inf or NaN) while units are updated "
                        "during the backward pass (overlap_optimizer): the units updated before "
                        "it in this step cannot be taken back, so the run stops here with this "
                        "unit not updated; resume from a checkpoint (without overlap_optimizer "
                        "such a step is skipped)",
                        e_.units[p.unit].name);
    }
  }
  {
    trace::Span span(e_.track("cpu adam"), "adam " + e_.units[p.unit].name);
    for (const zero::Segment& seg : zero::segments(st.layout, p.begin, p.end)) {
      kernels::AdamConfig cfg = adam;
      if (!seg.weight_decay) cfg.weight_decay = 0;
      const uint64_t si = seg.begin - p.begin, pidx = e_.param_index(st, seg.begin);
      kernels::AdamTensors t{
          .param = mixed ? static_cast<float*>(master.data()) + si
                         : static_cast<float*>(params.data()) + pidx,
          .m = static_cast<float*>(m.data()) + si,
          .v = static_cast<float*>(v.data()) + si,
          .grad = static_cast<const float*>(acc.data()) + (seg.begin - p.acc_base),
          .grad_dtype = DType::kF32,
          .param_copy = mixed ? static_cast<char*>(params.data()) + pidx * wsize : nullptr,
          .copy_dtype = e_.s.dtype,
          .n = seg.end - seg.begin};
      if (tier == Tier::kDevice) {
        e_.device->adam(cfg, args, t, *e_.optimizer_stream);
      } else {  // ZeRO-Offload: CPU Adam on host-resident state
        kernels::adam_step(cfg, args, t, e_.s.optimizer_threads);
      }
    }
    if (tier == Tier::kDevice) ZINF_RETURN_IF_ERROR(sync(*e_.optimizer_stream));
  }
  params.mark_dirty();
  if (mixed) master.mark_dirty();
  m.mark_dirty();
  v.mark_dirty();
  params.release();
  master.release();
  m.release();
  v.release();
  acc.release();
  updated_[pi] = 1;
  if (updates_early()) ++pieces_updated_early_;
  // What the unit's pieces share (its parameters, a full accumulator) goes once all of them are
  // done: the walk may visit a unit's pieces out of order.
  const bool unit_done =
      std::all_of(st.pieces.begin(), st.pieces.end(), [&](size_t q) { return updated_[q]; });
  if (tier != Tier::kDevice) {
    const size_t rank = pi < walk_rank_.size() ? walk_rank_[pi] : SIZE_MAX;
    if (rank < keep.state_ranks) {
      // The next walk needs this state first: it stays here, dirty, rather than being written now
      // and read back (written out only if the store needs its room, farthest next use first).
      for (TensorId id : {p.m, p.v, p.master}) {
        if (id != kNoTensor) e_.store->set_next_use(id, keep.state_tick + rank);
      }
    } else if (rank != SIZE_MAX && rank >= keep.write_behind_from) {
      // Written during the next backward pass (write_behind()), not under this forward pass.
      std::lock_guard lk(write_behind_mu_);
      for (TensorId id : {p.m, p.v, p.master}) {
        if (id == kNoTensor) continue;
        e_.store->set_next_use(id, keep.state_tick + rank);
        write_behind_.push_back(id);
      }
    } else {
      e_.release_offloaded(p.m, st.opt_home, tier);
      e_.release_offloaded(p.v, st.opt_home, tier);
      if (mixed) e_.release_offloaded(p.master, st.opt_home, tier);
    }
    if (p.owns_acc || unit_done) {
      // The gradient is spent: the next step overwrites the accumulator (acc_zero), so its copy
      // here goes without being written back. A copy the store is still moving is left to it;
      // the eviction below then takes it once free (a no-op after a discard).
      ZINF_RETURN_IF_ERROR(e_.discard_offloaded(p.acc, st.opt_home, tier));
      e_.release_offloaded(p.acc, st.opt_home, tier);
      e_.store->clear_next_use(p.acc);  // the walk position set in record_sums() is past
    }
  }
  if (e_.policy.sharded_params && unit_done) {
    if (updates_early() && params_stay_on_device() && tier != Tier::kDevice &&
        refresh_device_copy(p.unit, keep.tick)) {
      // The next forward pass uses the refreshed device copy; the host copy, now clean, goes
      // without being written.
      e_.release_offloaded(st.params, e_.s.param_home, tier);
    } else if (keep.params && tier != Tier::kDevice && p.unit < first_use_.size()) {
      // The next forward pass gathers them soon (update_behind): from here, not from NVMe. They
      // stay as they are, not written back: the store writes them out only if it needs their
      // room (a dirty copy goes after the clean ones), or once the pass's device copy is the only
      // one left and goes; a shard that stays in memory until the next walk updates it again
      // never reaches the disk in between.
      e_.store->set_next_use(st.params, keep.tick + first_use_[p.unit]);
    } else {
      e_.release_offloaded(st.params, e_.s.param_home, tier);
    }
  }
  return Status::ok();
}

bool OptimizerPipeline::refresh_device_copy(size_t u, uint64_t next_use) {
  const TensorId params = e_.unit_states[u].params;
  auto device = e_.store->acquire(params, Tier::kDevice);
  if (!device.is_ok()) {  // an optimisation only: the shard then goes to NVMe as before
    log::debug("engine: {}'s device copy not refreshed after its update: {}", e_.units[u].name,
               device.status().to_string());
    return false;
  }
  device->release();
  if (next_use > 0) e_.store->set_next_use(params, next_use);
  return true;
}

// Starts bringing a piece's optimizer state (and its unit's parameters) to where the update runs.
void OptimizerPipeline::prefetch_piece(size_t pi, PrefetchRoom room) {
  prefetch_state(pi, room);
  const PieceState& p = e_.pieces[pi];
  const UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  for (TensorId id : {st.params, p.acc}) {
    if (id != kNoTensor) e_.store->prefetch(id, tier, room);
  }
}

void OptimizerPipeline::prefetch_state(size_t pi, PrefetchRoom room) {
  const PieceState& p = e_.pieces[pi];
  const Tier tier = EngineState::compute_tier(e_.unit_states[p.unit]);
  for (TensorId id : {p.m, p.v, p.master}) {
    if (id != kNoTensor) e_.store->prefetch(id, tier, room);
  }
}

void OptimizerPipeline::append_reads(size_t pi, std::vector<std::pair<TensorId, Tier>>& reads,
                                     bool with_params) {
  const PieceState& p = e_.pieces[pi];
  const UnitState& st = e_.unit_states[p.unit];
  const Tier tier = EngineState::compute_tier(st);
  // An accumulator that is zero and whose unit's gradients are still to come (behind step(),
  // the walk's first groups are read from the backward pass's start) holds nothing: the pass
  // overwrites it (acc_zero), so reading its home's old bytes would be a wasted read.
  const bool acc_dead = st.acc_zero && !st.grads_final;
  for (TensorId id :
       {with_params ? st.params : kNoTensor, p.master, p.m, p.v, acc_dead ? kNoTensor : p.acc}) {
    if (id != kNoTensor) reads.emplace_back(id, tier);  // as update_piece() takes them
  }
}

}  // namespace zinf::engine_detail
