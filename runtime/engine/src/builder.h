// Building one rank's engine: validating the settings, laying out the units, choosing the
// budgets (zinf/engine/budgets.h, agreed across ranks), opening the tiers (device and streams,
// NVMe swap, pinned pool, the store), planning the optimizer's sub-groups, creating every tensor
// where the stage policy and the offload settings put it, and initialising the parameters.
#pragma once

#include "engine_state.h"
#include "optimizer_pipeline.h"

namespace zinf::engine_detail {

Status build_engine(EngineState& e, OptimizerPipeline& optimizer);

}  // namespace zinf::engine_detail
