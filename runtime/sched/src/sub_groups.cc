#include "zinf/sched/sub_groups.h"

#include <algorithm>

#include "zinf/core/status.h"

namespace zinf::sched {

SubGroupPlan plan_sub_groups(const std::vector<std::vector<ElementRange>>& owned,
                             uint64_t sub_group_elements, uint64_t align) {
  ZINF_CHECK(align > 0, "sub-group alignment must be positive");
  SubGroupPlan plan;
  const uint64_t limit =
      sub_group_elements == 0 ? 0 : (sub_group_elements + align - 1) / align * align;
  uint64_t group_elements = 0;
  for (size_t u = 0; u < owned.size(); ++u) {
    const size_t unit_first_piece = plan.pieces.size();
    for (const ElementRange& r : owned[u]) {
      ZINF_CHECK(r.begin <= r.end, "range [{}, {}) of unit {}", r.begin, r.end, u);
      for (uint64_t b = r.begin; b < r.end;) {
        uint64_t e = limit == 0 ? r.end : std::min(r.end, b + limit);
        plan.pieces.push_back({.unit = u, .range = {b, e}});
        b = e;
      }
    }
    for (size_t p = unit_first_piece; p < plan.pieces.size(); ++p) {
      const uint64_t n = plan.pieces[p].range.size();
      const bool new_group =
          plan.groups.empty() || (limit == 0 ? p == unit_first_piece : group_elements + n > limit);
      if (new_group) {
        plan.groups.emplace_back();
        group_elements = 0;
      }
      plan.groups.back().push_back(p);
      group_elements += n;
    }
  }
  return plan;
}

}  // namespace zinf::sched
