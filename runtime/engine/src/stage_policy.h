// What a ZeRO stage partitions and where each piece of state lives, computed once from the
// stage (docs/engine.md's table). The engine's parts ask the policy; they never compare stage
// numbers.
//
//   stage 0: every rank holds everything; gradients are all-reduced and every rank updates
//            every shard (computing each rank's norm partial as that rank would);
//   stage 1: optimizer state partitioned; full parameters; a full gradient accumulator of which
//            each rank fills only its shard (reduce-scatter); updated shards all-gathered;
//   stage 2: + gradients partitioned: a shard-sized accumulator;
//   stage 3: + parameters partitioned: each rank holds its parameter shard and units are
//            all-gathered for each use (the scheduler gathers ahead and keeps).
#pragma once

#include <cstdint>
#include <vector>

#include "zinf/sched/sub_groups.h"
#include "zinf/zero/shard_layout.h"

namespace zinf::engine_detail {

struct StagePolicy {
  int stage = 0;
  bool owns_every_shard = false;       // 0: all-reduce; this rank updates every shard
  bool full_grad_accumulator = false;  // 1: the accumulator spans the unit
  bool sharded_params = false;         // 3: parameter shards, gathered per use
  bool share_updated_params = false;   // 1, 2: all-gather the updated shards after the step

  static StagePolicy for_stage(int stage) {
    return {.stage = stage,
            .owns_every_shard = stage == 0,
            .full_grad_accumulator = stage == 1,
            .sharded_params = stage == 3,
            .share_updated_params = stage == 1 || stage == 2};
  }

  // The part of a unit's flat parameters this rank holds: [param_begin, param_begin + elements).
  uint64_t param_begin(const zero::ShardLayout& l, int rank) const {
    return sharded_params ? l.shard_begin(rank) : 0;
  }
  uint64_t param_elements(const zero::ShardLayout& l) const {
    return sharded_params ? l.shard_numel : l.numel_padded;
  }
  // Index of flat element `flat` in this rank's parameter tensor.
  uint64_t param_index(const zero::ShardLayout& l, int rank, uint64_t flat) const {
    return flat - param_begin(l, rank);
  }
  // Elements whose optimizer state this rank holds, and of its gradient accumulator.
  uint64_t owned_elements(const zero::ShardLayout& l) const {
    return owns_every_shard ? l.numel_padded : l.shard_numel;
  }
  uint64_t accumulator_elements(const zero::ShardLayout& l) const {
    return full_grad_accumulator ? l.numel_padded : owned_elements(l);
  }
  // The flat ranges whose optimizer state this rank holds: its shard, or every rank's shard
  // when it owns them all (kept apart, so that a piece never straddles two shards: the norm adds
  // each rank's shard as that rank would).
  std::vector<sched::ElementRange> owned_ranges(const zero::ShardLayout& l, int rank,
                                                int world) const {
    std::vector<sched::ElementRange> out;
    for (int r = 0; r < world; ++r) {
      if (owns_every_shard || r == rank) out.push_back({l.shard_begin(r), l.shard_end(r)});
    }
    return out;
  }
};

}  // namespace zinf::engine_detail
