#include "fused_updates.h"

#include <algorithm>

namespace zinf::engine_detail {

void FusedUpdates::start(size_t u, const kernels::AdamStepArgs& args) {
  ++units_started_;
  std::vector<size_t> mine = e_.unit_states[u].pieces;
  // The state of the step's last updates is left for a write under the next forward pass.
  Keep keep;
  if (e_.sched->following()) {
    // The refreshed device copy's next use (taken on this thread).
    keep.tick = plan_.next_pass_tick(u, e_.steps, e_.sched->trace().size());
    keep.state_tick = static_cast<uint64_t>(e_.steps + 2) * e_.sched->trace().size();
    keep.write_behind_from = plan_.write_behind_from(0);
  }
  // The walk's group after u's: the next unit's update needs its state as soon as that unit's
  // gradients are final, so it is read while u is updated (its parameters and accumulator are
  // still in the pass's use). Only with the shards left on the device: otherwise the host budget
  // also holds each unit's shard for its update, and a read this early may be evicted unused.
  std::vector<size_t> next;
  if (e_.s.pipeline_read && e_.updates.params_stay_on_device && !mine.empty() &&
      e_.sched->following()) {
    size_t last = 0;
    for (size_t pi : mine) last = std::max(last, plan_.rank_of(pi));
    if (last + 1 < plan_.size()) next = plan_.group(last + 1);
  }
  worker_->submit([this, mine, next, args, adam = e_.s.adam, keep]() -> Status {
    for (size_t k = 0; k < mine.size(); ++k) {
      if (e_.s.pipeline_read) {  // this piece (the first time) and the next one
        if (k == 0) updater_.prefetch_piece(mine[0]);
        if (k + 1 < mine.size()) updater_.prefetch_piece(mine[k + 1]);
        if (k == 0) {
          for (size_t pi : next) updater_.prefetch_state(pi, PrefetchRoom::kCleanOnly);
        }
      }
      ZINF_RETURN_IF_ERROR(updater_.update(mine[k], args, adam, keep));
    }
    return Status::ok();
  });
}

void FusedUpdates::read_next_pass_first() {
  const uint64_t largest = plan_.room().largest_state;
  if (!e_.s.pipeline_read || !e_.updates.params_stay_on_device || !e_.sched->following() ||
      largest == 0) {
    return;
  }
  std::vector<std::pair<TensorId, Tier>> reads;
  uint64_t bytes = 0;
  for (size_t r = 0; r < plan_.size(); ++r) {
    bytes += plan_.state_bytes(r);
    if (bytes > 2 * largest) break;
    for (size_t pi : plan_.group(r)) updater_.append_reads(pi, reads, /*with_params=*/false);
  }
  if (!reads.empty()) e_.store->prefetch_in_order(std::move(reads), PrefetchRoom::kCleanOnly);
}

}  // namespace zinf::engine_detail
