// Gradient reduction: when a scope with gradients ends, the unit's gradient buffer is averaged
// over ranks — all-reduced when every rank owns every shard, reduce-scattered into this rank's
// shard otherwise — in buckets of reduce_bucket_size elements, asynchronously. With one rank the
// average is the buffer itself: nothing is issued or copied. When a reduction
// completes, its result is added in fp32 into the accumulators of this rank's pieces, in issue
// order (micro-steps add in order, so the bits never depend on timing): a device operation for
// accumulators on the device, the CPU kernel after a copy down for offloaded ones. With
// overlap_comm at most two reductions stay in flight (fewer when the device budget holds fewer
// gradient buffers: EngineState::max_reductions_in_flight); without, each completes before the
// scope's end returns. The unit's last reduction of the step (the trace says it is not used again)
// tells the optimizer pipeline that its gradients are final. A reduction's buffers belong to the
// communicator until its works complete: abandon() waits for them.
#pragma once

#include <deque>
#include <vector>

#include "engine_state.h"
#include "optimizer_pipeline.h"

namespace zinf::engine_detail {

class GradReducer {
 public:
  GradReducer(EngineState& e, OptimizerPipeline& optimizer) : e_(e), optimizer_(optimizer) {}

  Status issue(size_t u, DeviceBuffer grads);
  // Accumulates, in order, the reductions at the front that have completed, and frees their
  // buffers, so that what stays in flight is only what is still moving (called at issue and
  // before a gradient buffer is taken). Where an accumulator cannot be had for lack of memory,
  // the reduction stays at the front with the pieces already added counted, and a later reap,
  // or the drain, goes on from there: a reap never fails for lack of memory.
  Status reap();
  // Completes every reduction in flight (accumulating each); the first failure.
  Status drain();
  // After a failure: waits for what is still in flight and drops it unaccumulated.
  void abandon();

 private:
  struct Pending {
    size_t unit;
    DeviceBuffer grads;  // the full gradient buffer (reduced in place by an all-reduce)
    DeviceBuffer shard;  // reduce-scatter (several ranks): this rank's reduced part
    // Or, reduced straight into the accumulator (direct_accumulator), held for the reduction.
    TensorHandle direct;
    std::vector<comm::Work> works;
    std::vector<Device::CommWindow> windows;  // the reductions' reach into grads and shard
    bool final = false;                       // the unit's last gradient of the step
    bool received = false;                    // the works completed and the windows closed
    size_t pieces_added = 0;                  // of the unit's pieces, in order
  };
  // Completes the front reduction and takes it off the queue. With `may_defer`, an accumulator
  // refused for lack of memory leaves it at the front (returns false) instead of failing.
  Result<bool> finish_front(bool may_defer = false);
  // issue()'s collectives, bucket by bucket, into the reduction's windows.
  void issue_buckets(Pending& p);
  // Waits for the front reduction's collectives and closes its windows; the first failure.
  Status receive(Pending& p);
  // Adds the received gradients into the unit's accumulators, piece by piece from where a
  // deferred reduction stopped; false when deferred (see finish_front).
  Result<bool> accumulate_pieces(Pending& p, bool may_defer);
  // Takes the front reduction off the queue; its unit's gradients may then be final.
  void pop_front(Pending& p);
  // Completes reductions at the front until at most max_reductions_in_flight remain.
  Status in_flight_bound();
  // The unit's accumulator, acquired to be overwritten by the reduce-scatter itself, when that
  // gives what the accumulation would: the first micro-step (the accumulator is lazily zero,
  // and no earlier reduction of the unit is queued), fp32 gradients, and one piece with this
  // rank's whole shard in device memory. Otherwise (or if it cannot be had) an empty handle.
  TensorHandle direct_accumulator(size_t u);
  Status accumulate_into(const TensorHandle& acc, uint64_t offset, const void* src, uint64_t n,
                         bool overwrite);

  EngineState& e_;
  OptimizerPipeline& optimizer_;
  std::deque<Pending> pending_;
  std::vector<char> host_scratch_;  // reduced gradients on their way to a host-tier accumulator
  // The accumulations' own stream: a reap inside a scope must neither wait for the model's work
  // on the engine's stream nor take a failure of it for its own.
  std::unique_ptr<Stream> stream_;  // made on first use (the device comes after the reducer)
  Stream& stream();
};

}  // namespace zinf::engine_detail
