// The optimizer's walk over its sub-groups, planned: in which order the groups are updated, and
// how much of the host budget each update mode may hold for state read ahead of the walk or kept
// after it. Pure arithmetic over sizes and the recorded trace, the same on every rank; tested
// alone (tests/engine/walk_plan_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zinf/sched/scheduler.h"

namespace zinf::engine_detail {

// What the host budget holds besides the walk, and what a group's read-ahead brings into it.
struct HostRoomInputs {
  uint64_t host_mem = 0;
  uint64_t staging_bytes = 0;    // the store's staging buffers
  uint64_t host_home_bytes = 0;  // state homed in host memory (with its accumulators)
  // The offloaded accumulators the backward pass fills when the state is homed on NVMe (homed on
  // the host they are in host_home_bytes).
  uint64_t nvme_accumulator_bytes = 0;
  uint64_t cpu_update_bytes = 0;       // the two parameter tensors an update holds at a time
  uint64_t largest_unit_elements = 0;  // the largest unit's padded elements
  bool pipeline_read = false;
  bool fused = false;                  // UpdatePolicy::fused
  bool params_stay_on_device = false;  // UpdatePolicy::params_stay_on_device
  // Per group: the host bytes of its m, v (and master) unless homed on the host; and what its
  // read-ahead brings in (that state plus the parameter tensors of its units that are read).
  std::vector<uint64_t> group_state_bytes;
  std::vector<uint64_t> group_read_bytes;
  uint64_t all_param_bytes = 0;  // every unit's parameter tensor that a walk reads
};

struct HostRoom {
  // How many of the walk's first groups are read during the backward pass: as many as fit beside
  // what the host holds anyway, each counted as the largest (more, and the accumulators the pass
  // fills afterwards would evict clean state just read, which would then be read twice).
  size_t groups_read_during_backward = 0;
  // Room for optimizer state kept across a step behind step() (Keep::state_ranks).
  uint64_t state_room = 0;
  // Room, once the walk has spent every accumulator, for the kept state and the state left dirty
  // until the next backward pass (Keep::write_behind_from).
  uint64_t write_behind_room = 0;
  uint64_t largest_state = 0;  // the largest group_state_bytes
};

HostRoom plan_host_room(const HostRoomInputs& in);

// What a walk keeps in memory after an update. With `params`, a unit's parameters, once its
// pieces are done, stay for the next forward pass, whose use comes at `tick` + the unit's first
// use in the trace; otherwise they are written back and dropped. The optimizer state (m, v, a
// mixed master) of the pieces in the walk's first `state_ranks` groups stays too, dirty, for the
// next walk, at `state_tick` + the group's rank: it is neither written now nor read back in
// between. The state of the groups from rank `write_behind_from` on (the walk's last, past the
// kept ones) stays dirty too, at the same ticks, and is written back later (write_behind), when
// the disk is otherwise idle. Fused into the backward pass, `tick` is the next use of the unit's
// refreshed device copy.
struct Keep {
  bool params = false;
  uint64_t tick = 0;
  size_t state_ranks = 0;
  uint64_t state_tick = 0;
  size_t write_behind_from = SIZE_MAX;
};

// The groups (of piece indices, in declaration order) and the order they are walked in.
class WalkPlan {
 public:
  WalkPlan() = default;
  // `piece_units`: each piece's unit; `units`: how many units there are.
  WalkPlan(std::vector<std::vector<size_t>> groups, std::vector<size_t> piece_units, size_t units,
           HostRoom room, std::vector<uint64_t> group_state_bytes);

  // Orders the walk by when each group's gradients become final in `trace` (its last use of the
  // group's units); `behind`: then by the units' first use instead (the next forward pass follows
  // the walk unit by unit). Groups of units the trace never uses go last.
  void order(const std::vector<size_t>& trace, bool behind);

  const std::vector<std::vector<size_t>>& groups() const { return groups_; }
  const std::vector<size_t>& walk() const { return walk_; }  // group indices, in walk order
  const std::vector<size_t>& group(size_t rank) const { return groups_[walk_[rank]]; }
  size_t size() const { return walk_.size(); }
  // The rank in the walk of a piece's group; SIZE_MAX for an index past the plan.
  size_t rank_of(size_t piece) const {
    return piece < walk_rank_.size() ? walk_rank_[piece] : SIZE_MAX;
  }
  // A unit's first use in the last trace order() saw; false before any.
  bool knows_first_uses() const { return first_use_.size() == units_; }
  bool has_first_use(size_t unit) const { return unit < first_use_.size(); }
  size_t first_use(size_t unit) const { return first_use_[unit]; }
  // The tick of unit u's first use in the pass after step `steps` (a trace of `trace_size` uses a
  // step), about when the next forward pass first uses it; past that pass's uses when unknown.
  uint64_t next_pass_tick(size_t u, int64_t steps, uint64_t trace_size) const {
    const uint64_t next = static_cast<uint64_t>(steps + 1) * trace_size;
    return has_first_use(u) ? next + first_use_[u] : next + trace_size;
  }
  const HostRoom& room() const { return room_; }
  uint64_t state_bytes(size_t rank) const { return group_state_bytes_[walk_[rank]]; }

  // How many of the walk's first groups have their state kept for the next walk: those whose
  // state fits, in walk order, in the room for it.
  size_t state_ranks_that_fit() const;
  // The first rank whose state is left for write_behind: the walk's last groups past the first
  // `state_ranks`, as many as fit in the room once every accumulator is spent.
  size_t write_behind_from(size_t state_ranks) const;
  // The pieces `pending(piece)` selects, by group, in walk order (empty groups left out).
  template <class Pred>
  std::vector<std::vector<size_t>> pieces(Pred pending) const {
    std::vector<std::vector<size_t>> todo;
    for (size_t g : walk_) {
      todo.emplace_back();
      for (size_t pi : groups_[g]) {
        if (pending(pi)) todo.back().push_back(pi);
      }
      if (todo.back().empty()) todo.pop_back();
    }
    return todo;
  }

 private:
  void rank_walk();

  std::vector<std::vector<size_t>> groups_;
  std::vector<size_t> piece_units_;
  size_t units_ = 0;
  HostRoom room_;
  std::vector<uint64_t> group_state_bytes_;  // per group (declaration order)
  std::vector<size_t> walk_;
  std::vector<size_t> walk_rank_;  // per piece
  std::vector<size_t> first_use_;  // per unit, in the last trace order() saw
};

}  // namespace zinf::engine_detail
