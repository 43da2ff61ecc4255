// Optimizer sub-groups (DeepSpeed's sub_group_size): the optimizer state a rank owns is cut into
// pieces, and consecutive pieces are packed into sub-groups that the optimizer walks as a
// pipeline (the read of group i+1, the update of group i and the write-back of group i-1 in
// flight together). One piece = one set of state tensors (fp32 master, m, v, gradient) in the
// tiered store, so a sub-group is also the unit of NVMe traffic and of host memory held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zinf::sched {

// A range of flat elements of one unit: [begin, end).
struct ElementRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
};

struct Piece {
  size_t unit = 0;
  ElementRange range;
};

struct SubGroupPlan {
  std::vector<Piece> pieces;                // in unit order, then range order
  std::vector<std::vector<size_t>> groups;  // indices into pieces, consecutive
};

// `owned[u]` lists the ranges of unit u whose optimizer state this rank holds, in order (one
// shard; or every rank's shard when it holds them all, at stage 0, so that no piece straddles two
// ranks' shards). Each range is cut into pieces of at most `sub_group_elements` rounded up to a
// multiple of `align` (cuts fall at multiples of `align` from the range's start), and
// consecutive pieces are packed into groups of at most that many elements (a piece never
// shares a group it would overflow). `sub_group_elements` 0: one piece per range and one group
// per unit. Empty ranges make no piece.
SubGroupPlan plan_sub_groups(const std::vector<std::vector<ElementRange>>& owned,
                             uint64_t sub_group_elements, uint64_t align);

}  // namespace zinf::sched
