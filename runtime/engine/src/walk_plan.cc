#include "walk_plan.h"

#include <algorithm>

namespace zinf::engine_detail {

namespace {
uint64_t room_beside(uint64_t budget, uint64_t held) { return held < budget ? budget - held : 0; }
}  // namespace

HostRoom plan_host_room(const HostRoomInputs& in) {
  HostRoom room;
  uint64_t largest_read = 0;
  for (uint64_t b : in.group_read_bytes) largest_read = std::max(largest_read, b);
  for (uint64_t b : in.group_state_bytes) room.largest_state = std::max(room.largest_state, b);
  // What the host budget holds anyway by the end of the backward pass.
  const uint64_t held = in.host_home_bytes + in.nvme_accumulator_bytes + in.staging_bytes;
  // Parameters left on the device come back to the host at the walk's start, two at a time, into
  // room taken off here too (or the walk's first copies evict the last group read).
  const uint64_t ahead_held = held + (in.params_stay_on_device ? in.cpu_update_bytes : 0);
  room.groups_read_during_backward =
      in.pipeline_read && largest_read > 0 && ahead_held < in.host_mem
          ? (in.host_mem - ahead_held) / largest_read
          : 0;
  // Behind step() the walk keeps every unit's parameters for the next forward pass; the state it
  // may keep besides is what fits beside those and the above. Parameters left on the device
  // between passes have clean host copies once gathered, which give way: only the two the walk
  // works on count.
  const uint64_t params_held = in.params_stay_on_device ? in.cpu_update_bytes : in.all_param_bytes;
  room.state_room = room_beside(in.host_mem, held + params_held);
  // By the walk's end every accumulator is spent: the state of its last groups may stay dirty
  // beside the kept state, the parameters as above and the next group's reads.
  uint64_t beside = params_held + in.host_home_bytes + in.staging_bytes + room.largest_state;
  if (in.fused) {
    // Fused into the backward pass, the last units' state stays dirty while the pass goes on, to
    // be written under the next forward pass. Beside it, the units still to be updated hold two
    // parameter copies, the accumulator being updated and the one being filled, and two groups'
    // state (the one updated, the next read). Only with the shards left on the device: otherwise
    // the next forward pass reads every shard from NVMe, and writes under it would hold those
    // reads up (no room).
    beside = in.params_stay_on_device
                 ? in.cpu_update_bytes + 2 * in.largest_unit_elements * 4 + in.host_home_bytes +
                       in.staging_bytes + 2 * room.largest_state
                 : in.host_mem;
  }
  room.write_behind_room = room_beside(in.host_mem, beside);
  return room;
}

WalkPlan::WalkPlan(std::vector<std::vector<size_t>> groups, std::vector<size_t> piece_units,
                   size_t units, HostRoom room, std::vector<uint64_t> group_state_bytes)
    : groups_(std::move(groups)),
      piece_units_(std::move(piece_units)),
      units_(units),
      room_(room),
      group_state_bytes_(std::move(group_state_bytes)) {
  for (size_t g = 0; g < groups_.size(); ++g) walk_.push_back(g);
  rank_walk();
}

void WalkPlan::order(const std::vector<size_t>& trace, bool behind) {
  // Stable sorts of the order as it is: groups that tie keep their place from the last step.
  std::vector<size_t> last_use(units_, trace.size());
  for (size_t i = 0; i < trace.size(); ++i) last_use[trace[i]] = i;
  std::vector<size_t> ready(groups_.size(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t pi : groups_[g]) ready[g] = std::max(ready[g], last_use[piece_units_[pi]]);
  }
  std::stable_sort(walk_.begin(), walk_.end(),
                   [&](size_t a, size_t b) { return ready[a] < ready[b]; });
  first_use_.assign(units_, trace.size());
  for (size_t i = trace.size(); i-- > 0;) first_use_[trace[i]] = i;
  if (behind) {
    auto key = [&](size_t g) {
      size_t k = trace.size();
      for (size_t pi : groups_[g]) k = std::min(k, first_use_[piece_units_[pi]]);
      return k;
    };
    std::stable_sort(walk_.begin(), walk_.end(),
                     [&](size_t a, size_t b) { return key(a) < key(b); });
  }
  rank_walk();
}

void WalkPlan::rank_walk() {
  walk_rank_.assign(piece_units_.size(), 0);
  for (size_t r = 0; r < walk_.size(); ++r) {
    for (size_t pi : groups_[walk_[r]]) walk_rank_[pi] = r;
  }
}

size_t WalkPlan::state_ranks_that_fit() const {
  uint64_t used = 0;
  size_t r = 0;
  for (; r < walk_.size(); ++r) {
    used += state_bytes(r);
    if (used > room_.state_room) break;
  }
  return r;
}

size_t WalkPlan::write_behind_from(size_t state_ranks) const {
  uint64_t kept = 0;
  for (size_t r = 0; r < std::min(state_ranks, walk_.size()); ++r) kept += state_bytes(r);
  const uint64_t room = room_.write_behind_room;
  if (kept >= room) return walk_.size();
  uint64_t left = 0;
  size_t r = walk_.size();
  while (r > state_ranks && left + state_bytes(r - 1) <= room - kept) left += state_bytes(--r);
  return r;
}

}  // namespace zinf::engine_detail
