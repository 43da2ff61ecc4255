#include "grad_reducer.h"

#include <algorithm>

#include "zinf/kernels/cpu_adam.h"

namespace zinf::engine_detail {

Status GradReducer::reap() {
  while (!pending_.empty() &&
         std::all_of(pending_.front().works.begin(), pending_.front().works.end(),
                     [](const comm::Work& w) { return w.ready(); })) {
    ZINF_ASSIGN_OR_RETURN(bool finished, finish_front(/*may_defer=*/true));
    if (!finished) break;
  }
  return Status::ok();
}

Status GradReducer::issue(size_t u, DeviceBuffer grads) {
  // Reductions that have completed meanwhile are accumulated (in order) and their buffers freed
  // before this one allocates its shard: what stays in flight is only what is still moving.
  ZINF_RETURN_IF_ERROR(reap());
  UnitState& st = e_.unit_states[u];
  const auto& l = st.layout;
  const uint64_t wsize = dtype_size(e_.s.dtype);
  Pending p{.unit = u, .grads = std::move(grads)};
  // The unit is not used again in this step, so this reduction completes its gradients.
  p.final = e_.sched->following() && !e_.sched->next_use(u) && st.scopes == 0;
  if (p.final && e_.updates.fused) st.final_issued = true;
  if (e_.world == 1) {
    // The average over one rank is the gradients as they are: accumulated from the buffer itself,
    // with no collective, no shard and nothing in flight.
    p.received = true;
    pending_.push_back(std::move(p));
    return in_flight_bound();
  }
  if (!e_.policy.owns_every_shard) {
    p.direct = direct_accumulator(u);
    if (!p.direct) {
      ZINF_ASSIGN_OR_RETURN(
          p.shard, e_.store->allocate_device(l.shard_numel * wsize, MemoryCategory::kBuffers,
                                             "reduced gradient shard of " + e_.units[u].name));
    }
  }
  issue_buckets(p);
  pending_.push_back(std::move(p));
  return in_flight_bound();
}

void GradReducer::issue_buckets(Pending& p) {
  const auto& l = e_.unit_states[p.unit].layout;
  const uint64_t wsize = dtype_size(e_.s.dtype);
  const int world = e_.world, rank = e_.rank;
  const uint64_t bucket = std::max<uint64_t>(e_.s.reduce_bucket_elements, 1);
  // The communicator works in its windows: the gradients (reduced in place at stage 0, read at
  // stages 1-3) and the shard the reduce-scatter writes whole.
  Device::CommWindow grads_window = e_.comm_window(
      p.grads.data(), l.numel_padded * wsize,
      e_.policy.owns_every_shard ? Device::WindowAccess::kReadWrite : Device::WindowAccess::kRead);
  Device::CommWindow shard_window;
  if (void* out = p.direct ? p.direct.data() : p.shard.data(); out != nullptr) {
    shard_window = e_.comm_window(out, l.shard_numel * wsize, Device::WindowAccess::kWrite);
  }
  auto* g = static_cast<char*>(grads_window.data());
  auto* shard = static_cast<char*>(shard_window.data());
  p.windows.push_back(std::move(grads_window));
  p.windows.push_back(std::move(shard_window));
  for (uint64_t a = 0; a < l.numel_padded; a += bucket) {
    const uint64_t b = std::min(l.numel_padded, a + bucket);
    if (e_.policy.owns_every_shard) {
      p.works.push_back(e_.comm.all_reduce(g + a * wsize, g + a * wsize, b - a, e_.s.dtype,
                                           comm::ReduceOp::kAvg));
      e_.comm_now.grad_reduce_elements += 2 * (b - a);
    } else {
      std::vector<size_t> counts(world);
      for (int r = 0; r < world; ++r) {
        const uint64_t lo = std::max(a, l.shard_begin(r)), hi = std::min(b, l.shard_end(r));
        counts[r] = hi > lo ? hi - lo : 0;
      }
      const uint64_t mine = std::max(a, l.shard_begin(rank));
      void* recv = shard + (mine < l.shard_end(rank) ? mine - l.shard_begin(rank) : 0) * wsize;
      p.works.push_back(
          e_.comm.reduce_scatter_v(g + a * wsize, recv, counts, e_.s.dtype, comm::ReduceOp::kAvg));
      e_.comm_now.grad_reduce_elements += b - a;
    }
  }
}

Status GradReducer::in_flight_bound() {
  const auto in_flight = static_cast<size_t>(std::max(e_.max_reductions_in_flight, 0));
  if (in_flight == 0) return drain();
  while (pending_.size() > in_flight) ZINF_RETURN_IF_ERROR(finish_front().status());
  return Status::ok();
}

Status GradReducer::drain() {
  while (!pending_.empty()) ZINF_RETURN_IF_ERROR(finish_front().status());
  return Status::ok();
}

void GradReducer::abandon() {
  for (auto& p : pending_) {
    for (auto& w : p.works) (void)w.wait();
  }
  pending_.clear();
}

Result<bool> GradReducer::finish_front(bool may_defer) {
  Pending& p = pending_.front();
  const size_t unit = p.unit;
  // On failure the reduction leaves the queue: the step fails, and abandon() drops the rest.
  auto fail = [&](Status s) {
    pending_.pop_front();
    return std::move(s).with_context(
        fmt::format("reducing the gradients of unit {}", e_.units[unit].name));
  };
  if (!p.received) {
    if (Status got = receive(p); !got.is_ok()) return fail(std::move(got));
  }
  if (!p.direct) {
    Result<bool> added = accumulate_pieces(p, may_defer);
    if (!added.is_ok()) return fail(added.status());
    if (!*added) return false;
    pop_front(p);
    return true;
  }
  // The reduce-scatter wrote the accumulator itself.
  const size_t pi = e_.unit_states[unit].pieces.front();
  optimizer_.sums().forget(pi);
  if (p.final) {
    if (Status s = optimizer_.record_sums(pi, p.direct, e_.pieces[pi].acc_base, stream());
        !s.is_ok()) {
      return fail(std::move(s));
    }
  }
  p.direct.release();
  pop_front(p);
  return true;
}

Status GradReducer::receive(Pending& p) {
  trace::Span span(e_.track("comm"), "reduce " + e_.units[p.unit].name);
  Status first;
  for (auto& w : p.works) {
    Status ws = w.wait();
    if (first.is_ok() && !ws.is_ok()) first = std::move(ws);
  }
  // The reduced gradients reach the device as the windows close.
  if (Status closed = close_windows(p.windows); first.is_ok()) first = std::move(closed);
  if (first.is_ok()) p.received = true;
  return first;
}

Result<bool> GradReducer::accumulate_pieces(Pending& p, bool may_defer) {
  UnitState& st = e_.unit_states[p.unit];
  // The first micro-step overwrites the (lazily zero) accumulators without fetching them; with a
  // full accumulator the bytes outside this rank's range are then unspecified, and never read.
  // acc_zero changes only once every piece is in, so a resumed reduction sees what it began with.
  const Access access = st.acc_zero ? Access::kOverwrite : Access::kRead;
  const uint64_t wsize = dtype_size(e_.s.dtype);
  TensorHandle acc;  // consecutive pieces may share one accumulator
  for (; p.pieces_added < st.pieces.size(); ++p.pieces_added) {
    const PieceState& piece = e_.pieces[st.pieces[p.pieces_added]];
    if (!acc || acc.id() != piece.acc) {
      // A deferral happens only here, where a piece with an accumulator of its own begins: the
      // pieces before it are complete, and a resumed reduction acquires this one afresh.
      acc.release();
      Result<TensorHandle> got =
          e_.store->acquire(piece.acc, EngineState::compute_tier(st), access);
      if (!got.is_ok()) {
        if (may_defer && got.status().code() == ErrorCode::kOutOfMemory) return false;
        return got.status();
      }
      acc = std::move(*got);
      acc.mark_dirty();
    }
    // The reduced gradients: the whole buffer (all-reduced, or one rank's), or this rank's shard.
    const char* reduced = p.shard ? static_cast<const char*>(p.shard.data()) +
                                        (piece.begin - st.layout.shard_begin(e_.rank)) * wsize
                                  : static_cast<const char*>(p.grads.data()) + piece.begin * wsize;
    optimizer_.sums().forget(st.pieces[p.pieces_added]);
    ZINF_RETURN_IF_ERROR(accumulate_into(acc, piece.begin - piece.acc_base, reduced,
                                         piece.end - piece.begin, /*overwrite=*/st.acc_zero));
    // The unit's last gradient of the step: the piece's sums of squares for the norm, now.
    if (p.final) {
      ZINF_RETURN_IF_ERROR(
          optimizer_.record_sums(st.pieces[p.pieces_added], acc, piece.acc_base, stream()));
    }
  }
  return true;
}

void GradReducer::pop_front(Pending& p) {
  e_.unit_states[p.unit].acc_zero = false;
  const size_t unit = p.unit;
  const bool final = p.final;
  pending_.pop_front();  // frees the gradient buffer and the shard
  if (final) optimizer_.on_grads_final(unit);
}

TensorHandle GradReducer::direct_accumulator(size_t u) {
  const UnitState& st = e_.unit_states[u];
  if (!st.acc_zero || e_.s.dtype != DType::kF32 || st.pieces.size() != 1 ||
      EngineState::compute_tier(st) != Tier::kDevice) {
    return {};
  }
  for (const Pending& q : pending_) {
    if (q.unit == u) return {};  // that one overwrites: this one must add
  }
  const PieceState& piece = e_.pieces[st.pieces.front()];
  if (piece.begin != st.layout.shard_begin(e_.rank) || piece.end != st.layout.shard_end(e_.rank) ||
      piece.acc_base != piece.begin) {
    return {};
  }
  Result<TensorHandle> acc = e_.store->acquire(piece.acc, Tier::kDevice, Access::kOverwrite);
  if (!acc.is_ok()) return {};  // the reduced shard takes its usual way (and reports a failure)
  acc->mark_dirty();
  return std::move(acc).value();
}

Stream& GradReducer::stream() {
  if (!stream_) stream_ = e_.device->create_stream(e_.track("reduce"));
  return *stream_;
}

Status GradReducer::accumulate_into(const TensorHandle& acc, uint64_t offset, const void* src,
                                    uint64_t n, bool overwrite) {
  float* dst = static_cast<float*>(acc.data()) + offset;
  if (acc.tier() == Tier::kDevice) {
    e_.device->accumulate({.data = dst, .dtype = DType::kF32, .numel = n}, {src, e_.s.dtype, n},
                          overwrite, stream());
    return sync(stream());
  }
  host_scratch_.resize(n * dtype_size(e_.s.dtype));
  e_.device->copy_async(host_scratch_.data(), src, host_scratch_.size(), stream());
  ZINF_RETURN_IF_ERROR(sync(stream()));
  kernels::accumulate(dst, host_scratch_.data(), e_.s.dtype, n, overwrite, e_.s.optimizer_threads);
  return Status::ok();
}

}  // namespace zinf::engine_detail
