// How the optimizer's updates are scheduled against the passes, decided once when the engine is
// built (like StagePolicy for what a stage partitions). The engine's parts read the policy; none
// of them recomputes a mode from the settings.
//
//   classic: step() takes the global norm (clipping, the non-finite check, fp16's overflow), then
//            walks the sub-groups in the order their gradients became final;
//   fused:   overlap_optimizer with nothing that needs every gradient first (no clipping, not
//            fp16): a unit's update starts on the optimizer worker as soon as its gradients are
//            final, during the backward pass;
//   behind:  update_behind with one rank, stage 3 and the optimizer offloaded (and not fused):
//            step() hands the walk to the worker once the norm is known and returns; the next
//            forward pass's gather of a unit waits for that unit's update.
#pragma once

#include "stage_policy.h"
#include "zinf/engine/engine.h"

namespace zinf::engine_detail {

struct UpdatePolicy {
  bool fused = false;
  bool behind = false;
  // The shards stay on the device between passes, and the walk takes each from there: fused or
  // behind, one rank, sharded parameters homed on NVMe (homed on the host, their host copy never
  // gives way), and the scheduler's live bound (what the device budget holds beside the step's
  // working set) takes every unit at once.
  bool params_stay_on_device = false;

  // Whether step() looks at the global norm's finiteness before updating: always but fused,
  // where updates start before the norm exists.
  bool checks_nonfinite() const { return !fused; }
  // Whether step() computes the global norm at all.
  bool takes_norm(const EngineSettings& s) const {
    return s.gradient_clipping > 0 || checks_nonfinite();
  }

  // Whether updates may be fused under these settings, whatever the rest of the engine (the
  // constructor's question: the worker and the start-up note depend on it alone).
  static bool fusable(const EngineSettings& s) {
    return s.overlap_optimizer && s.gradient_clipping <= 0 && s.dtype != DType::kF16;
  }

  // `device_holds_all_params`: the scheduler's live bound takes every unit at once.
  static UpdatePolicy decide(const EngineSettings& s, const StagePolicy& stage, int world,
                             bool device_holds_all_params) {
    UpdatePolicy p;
    p.fused = fusable(s);
    p.behind = s.update_behind && world == 1 && stage.sharded_params && !p.fused &&
               s.optimizer_home != Tier::kDevice;
    p.params_stay_on_device = world == 1 && stage.sharded_params && s.param_home == Tier::kNvme &&
                              device_holds_all_params && (p.behind || p.fused);
    return p;
  }
};

}  // namespace zinf::engine_detail
