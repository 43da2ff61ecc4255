// One rank's engine: the shared state and the parts that work on it, each with one job
// (docs/architecture.md, "The engine's parts"), and the step that drives them (step.cc).
#pragma once

#include <optional>
#include <string>

#include "builder.h"
#include "engine_state.h"
#include "gatherer.h"
#include "grad_reducer.h"
#include "loss_scaler.h"
#include "optimizer_pipeline.h"
#include "step_agreement.h"
#include "zinf/engine/engine.h"

namespace zinf {

struct Engine::Impl {
  engine_detail::EngineState e;
  engine_detail::LossScaler scaler;
  engine_detail::StepAgreement agreement;  // counts into e.comm_now.control_elements
  engine_detail::OptimizerPipeline optimizer;
  engine_detail::GradReducer reducer;
  engine_detail::Gatherer gatherer;
  int64_t step_calls = 0;           // step() calls so far, this one included: "step N" in errors
  int64_t skipped_steps = 0;        // skipped for a non-finite gradient norm
  uint64_t nonfinite_in_a_row = 0;  // the skips since the last committed step that count

  Impl(const EngineSettings& settings, comm::Communicator& c)
      : e(settings, c),
        scaler(settings),
        agreement(c, e.comm_now.control_elements),
        optimizer(e, scaler),
        reducer(e, optimizer),
        gatherer(e, optimizer) {}

  Status build() { return engine_detail::build_engine(e, optimizer); }

  // A step either happens on every rank or on none. Every rank goes through the same collectives
  // whatever failed locally (StepAgreement), so no rank is left waiting in a collective the others
  // skipped; a failure anywhere fails step() everywhere, each rank keeps the pieces it updated,
  // and the next step() finishes the update on every rank.
  Status step(StepInfo& info);
  // The update of the last step when it runs behind step(): waits for it. A failure leaves that
  // step incomplete (the next step() finishes it).
  Status settle_behind();
  // Settles what the backward pass left in flight (reductions, fused updates, gathered units)
  // and closes the step in the scheduler.
  Status settle_backward(StepInfo& info);

 private:
  // The global gradient norm from every rank's partial sum of squares, added in rank order; one
  // pass also gives fp16's overflow check (the sum is non-finite exactly when a gradient is).
  struct GlobalNorm {
    bool ok = true;  // every rank computed its partial (and this rank's step is whole so far)
    double sum_squares = 0;
  };
  // What one step() call learns on its way.
  struct StepFacts {
    Status local;                    // this rank's first failure
    Status writeback;                // the first write-back failure: the data stays valid in memory
    std::optional<size_t> poisoned;  // fused: the unit whose non-finite gradient skips the step
    GlobalNorm norm;
    bool skip = false;  // a non-finite norm (or a poisoned fused step): nothing is updated
  };

  Status finish_behind(StepInfo& info);
  StepFacts settle_gradients(StepInfo& info);
  Status collect_write_backs();
  Status take_norm(StepFacts& f, StepInfo& info);
  Result<GlobalNorm> global_norm(Status& local);
  Status update(StepFacts& f, const StepInfo& info);
  Status agree_outcome(StepFacts& f);
  float clip_coef(double grad_norm) const;
  std::string skip_reason(const StepFacts& f) const;
  Status skip(StepInfo& info, const std::string& what);
  Status commit(StepInfo& info);

  // The norm of this step's gradients once every rank computed its partial, until the step
  // commits or is skipped: a step() that finishes an update left incomplete uses it (the
  // accumulators of the pieces already updated are spent by then).
  std::optional<GlobalNorm> agreed_norm_;
  // The unit whose non-finite gradient the step's first fused update met (one rank), until the
  // step is skipped.
  std::optional<size_t> nonfinite_unit_;
};

}  // namespace zinf
