#include "norm_sums.h"

#include "zinf/kernels/cpu_adam.h"

namespace zinf::engine_detail {

namespace {
// The 1024-element block sums of squares of piece `p`'s gradient, `acc` holding it.
Status piece_block_sums(EngineState& e, Stream& stream, const PieceState& p,
                        const TensorHandle& acc, uint64_t acc_base, float factor,
                        std::vector<double>& blocks) {
  const uint64_t n = p.end - p.begin;
  blocks.resize(kernels::sum_squares_block_count(n));
  const float* grads = static_cast<const float*>(acc.data()) + (p.begin - acc_base);
  if (acc.tier() == Tier::kDevice) {
    e.device->sum_squares_blocks({grads, DType::kF32, n}, factor, blocks.data(), stream);
    return sync(stream);
  }
  kernels::grad_sum_squares_blocks(grads, DType::kF32, n, factor, blocks.data(),
                                   e.s.optimizer_threads);
  return Status::ok();
}
}  // namespace

Status NormSums::record(size_t pi, const TensorHandle& acc, uint64_t acc_base, Stream& stream,
                        float factor) {
  Sums& s = sums_[pi];
  s.valid = false;
  if (e_.updates.fused) return Status::ok();
  // The accumulator's next use is the update walk, after this step's trace, in walk order: when
  // the host budget cannot keep every accumulator until then, the ones used last are written
  // out (farthest next use), and the walk starts with its first accumulators in memory, whose
  // room it gets back as it goes.
  if (plan_.rank_of(pi) != SIZE_MAX && e_.sched->following()) {
    const uint64_t trace = e_.sched->trace().size();
    e_.store->set_next_use(e_.pieces[pi].acc,
                           (static_cast<uint64_t>(e_.steps) + 1) * trace + plan_.rank_of(pi));
  }
  s.factor = factor;
  ZINF_RETURN_IF_ERROR(
      piece_block_sums(e_, stream, e_.pieces[pi], acc, acc_base, factor, s.blocks));
  s.valid = true;
  return Status::ok();
}

bool NormSums::recorded(size_t pi, float factor) const {
  return sums_[pi].valid && sums_[pi].factor == factor &&
         !e_.unit_states[e_.pieces[pi].unit].acc_zero;
}

Result<double> NormSums::partial(int range_rank, float factor) {
  std::vector<size_t> selected;
  for (const UnitState& st : e_.unit_states) {
    const uint64_t lo = st.layout.shard_begin(range_rank), hi = st.layout.shard_end(range_rank);
    for (size_t pi : st.pieces) {
      if (e_.pieces[pi].begin >= lo && e_.pieces[pi].end <= hi) selected.push_back(pi);
    }
  }
  std::vector<size_t> to_read;  // the accumulators that must be read, in order
  for (size_t pi : selected) {
    if (!recorded(pi, factor)) to_read.push_back(pi);
  }
  // Recorded sums give the same blocks, added in the same order.
  double total = 0;
  std::vector<double> blocks;
  size_t next_read = 0;
  for (size_t pi : selected) {
    if (recorded(pi, factor)) {
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
    ZINF_RETURN_IF_ERROR(piece_block_sums(e_, *e_.stream, p, acc, p.acc_base, factor, blocks));
    for (double b : blocks) total += b;
  }
  return total;
}

}  // namespace zinf::engine_detail
