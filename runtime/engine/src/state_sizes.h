// What a placement needs per rank, computed from the units' layouts. Shared by the builder (which
// sizes the budgets from it) and the estimator (`zinf estimate`), so that what zinf predicts and
// what it allocates come from one computation.
#pragma once

#include <cstdint>
#include <vector>

#include "stage_policy.h"
#include "zinf/engine/budgets.h"
#include "zinf/engine/engine.h"
#include "zinf/zero/shard_layout.h"

namespace zinf::engine_detail {

inline constexpr uint32_t kStoreMovers = 2;  // the store's mover threads (each has a staging lane)

// The store's staging buffers (taken from the host budget): only when some state is on NVMe.
uint64_t staging_total_bytes(const EngineSettings& s, bool nvme);

// Partial offload (DeepSpeed's Twin-Flow `ratio`): the first units, in declaration order,
// holding about `ratio` of the parameters have their optimizer state offloaded; the others keep
// it on the device and are updated there. Whole units: the optimizer's home of each.
std::vector<Tier> optimizer_homes(const EngineSettings& s,
                                  const std::vector<zero::ShardLayout>& layouts);

// The sizes budgets.h works from: homed bytes per tier (parameters in the working dtype; fp32
// m, v, gradient accumulator and, in mixed precision, master of the elements this rank owns,
// where each unit's optimizer lives), the largest unit, the CPU update's parameter copies,
// staging.
StateSizes measure_state(const EngineSettings& s, const StagePolicy& policy,
                         const std::vector<zero::ShardLayout>& layouts,
                         const std::vector<Tier>& opt_homes, int world);

}  // namespace zinf::engine_detail
