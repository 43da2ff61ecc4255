// The global gradient norm's partial sums, one rank's share. A partial adds fixed 1024-element
// block sums of squares (kernels::kSumSquaresBlockElems) left to right in unit order, so it does
// not depend on how the state is cut into pieces. A piece's blocks are taken when its gradient
// becomes final (record), while it is in memory, so that the partial need not read it back (from
// NVMe, when the host budget could not keep it); any later addition to the piece forgets them.
#pragma once

#include <cstddef>
#include <vector>

#include "engine_state.h"
#include "update_policy.h"
#include "walk_plan.h"

namespace zinf::engine_detail {

class NormSums {
 public:
  NormSums(EngineState& e, const WalkPlan& plan) : e_(e), plan_(plan) {}

  void reset(size_t pieces) { sums_.assign(pieces, Sums{}); }
  // A piece's gradient is final: `acc` holds it, its element 0 at flat index `acc_base`; its
  // block sums (times `factor`) are taken now. Not when fused: no norm is taken.
  Status record(size_t pi, const TensorHandle& acc, uint64_t acc_base, Stream& stream,
                float factor);
  void forget(size_t pi) {
    if (pi < sums_.size()) sums_[pi].valid = false;
  }
  void forget_all() {
    for (Sums& s : sums_) s.valid = false;
  }
  // This rank's partial for the shard ranges of `range_rank` (stage 0 computes every rank's),
  // from the recorded sums where they were taken with `factor`, reading the other accumulators.
  Result<double> partial(int range_rank, float factor);

 private:
  struct Sums {
    bool valid = false;
    float factor = 0;
    std::vector<double> blocks;
  };
  bool recorded(size_t pi, float factor) const;

  EngineState& e_;
  const WalkPlan& plan_;
  std::vector<Sums> sums_;  // per piece
};

}  // namespace zinf::engine_detail
