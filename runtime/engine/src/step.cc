// Engine::Impl's step: the backward pass settled, the norm agreed, the update, the outcome agreed,
// then the commit or the skip.
#include <cmath>
#include <limits>

#include "engine_impl.h"
#include "zinf/core/log.h"

namespace zinf {

using engine_detail::UnitState;

Status Engine::Impl::step(StepInfo& info) {
  if (!e.fatal.is_ok()) return e.fatal;
  ++step_calls;
  // The last step's update, when it ran behind step(), ends first. Failed, it is finished here
  // (by this call, or by the next one when the failure is met only now).
  ZINF_RETURN_IF_ERROR(settle_behind());
  if (optimizer.behind().failed()) return finish_behind(info);
  StepFacts f = settle_gradients(info);
  ZINF_RETURN_IF_ERROR(take_norm(f, info));
  if (f.norm.ok && !f.skip) f.local = update(f, info);
  ZINF_RETURN_IF_ERROR(agree_outcome(f));
  if (f.skip) {
    Status stop = skip(info, skip_reason(f));
    return stop.is_ok() ? f.writeback : stop;
  }
  Status committed = commit(info);
  return f.writeback.is_ok() ? committed : f.writeback;
}

Status Engine::Impl::settle_behind() {
  if (!optimizer.behind().pending()) return Status::ok();
  Status st = optimizer.behind().wait();
  if (!st.is_ok()) e.update_incomplete = true;
  return st;
}

// A step() after an update behind failed: what the walk did not update is updated now, with the
// step's own hyperparameters. The pass begun since (up to the gather that met the failure) is
// settled and its gradients are dropped: its micro-steps have to run again.
Status Engine::Impl::finish_behind(StepInfo& info) {
  (void)settle_backward(info);  // its reductions and gathered units (its gradients are dropped)
  Status writeback = collect_write_backs();
  ZINF_RETURN_IF_ERROR(optimizer.behind().finish(writeback));
  optimizer.commit();
  e.update_incomplete = false;
  info.step = e.steps;
  info.loss_scale = scaler.scale();
  info.skipped_steps = skipped_steps;
  Status end = e.finish_evictions();
  return writeback.is_ok() ? end : writeback;
}

Status Engine::Impl::settle_backward(StepInfo& info) {
  Status st = reducer.drain();
  if (Status w = optimizer.fused().wait(); st.is_ok()) st = std::move(w);
  gatherer.drop_all();
  e.schedule_now.following = e.sched->following();  // of the step that ends here
  if (!e.sched->on_step_end()) {
    log::warn_once("engine:trace-short",
                   "a step used fewer units than the recorded one; re-recording (reported once)");
  }
  optimizer.plan_walk();
  info.units_updated_early = optimizer.fused().take_units_started();
  for (UnitState& u : e.unit_states) u.final_issued = false;
  return st;
}

// The backward pass settled, this rank's failures so far gathered, the accumulators that received
// no gradient zeroed.
Engine::Impl::StepFacts Engine::Impl::settle_gradients(StepInfo& info) {
  StepFacts f;
  f.local = settle_backward(info);
  // Kept until the skip: a step() that fails before it leaves the step to the next call.
  if (auto unit = optimizer.updater().take_nonfinite_before_any_update()) nonfinite_unit_ = unit;
  f.poisoned = nonfinite_unit_;
  if (!e.sticky.is_ok()) {  // a scope's end could not issue its reduction: gradients missing
    if (f.local.is_ok()) f.local = std::move(e.sticky);
    e.sticky = Status();
  }
  f.writeback = collect_write_backs();
  if (f.local.is_ok()) f.local = optimizer.zero_untouched_accumulators();
  return f;
}

// The first write-back failure since the last call, the engine's or the walk behind step()'s.
// The data stays valid in memory (and is written back later): the step goes on.
Status Engine::Impl::collect_write_backs() {
  Status writeback = e.finish_evictions();
  if (Status behind = optimizer.behind().take_writeback(); writeback.is_ok()) {
    writeback = std::move(behind);
  }
  return writeback;
}

// The norm every rank agrees on, and whether the step is skipped: a non-finite norm (fp16: an
// overflow) skips the update in every precision (every rank sees the same partials and decides
// the same); fused, so does a non-finite gradient met before any unit was updated (one rank).
Status Engine::Impl::take_norm(StepFacts& f, StepInfo& info) {
  Result<GlobalNorm> exchanged = GlobalNorm{};
  if (agreed_norm_) {
    exchanged = *agreed_norm_;
    exchanged->ok &= f.local.is_ok();
  } else {
    exchanged = global_norm(f.local);
  }
  if (!exchanged.is_ok()) {  // the exchange itself failed: nothing was updated anywhere
    e.update_incomplete = true;
    return exchanged.status();
  }
  f.norm = *exchanged;
  if (f.norm.ok) agreed_norm_ = f.norm;
  info.grad_norm = f.norm.ok ? std::sqrt(f.norm.sum_squares) : 0;
  if (f.poisoned) info.grad_norm = std::numeric_limits<double>::quiet_NaN();  // (not taken)
  f.skip = f.norm.ok &&
           ((e.updates.checks_nonfinite() && !std::isfinite(f.norm.sum_squares)) || f.poisoned);
  return Status::ok();
}

// `local` failed: this rank sends the failure sentinel instead of its partial.
Result<Engine::Impl::GlobalNorm> Engine::Impl::global_norm(Status& local) {
  GlobalNorm norm;
  if (e.updates.takes_norm(e.s)) {
    const float factor = optimizer.combined_scale();
    if (e.policy.owns_every_shard) {
      // Every rank holds every shard: compute each rank's partial exactly as that rank would.
      for (int r = 0; r < e.world && local.is_ok(); ++r) {
        auto p = optimizer.sums().partial(r, factor);
        if (p.is_ok()) {
          norm.sum_squares += *p;
        } else {
          local = p.status();
        }
      }
    } else {
      double mine = engine_detail::StepAgreement::kFailed;
      if (local.is_ok()) {
        auto p = optimizer.sums().partial(e.rank, factor);
        if (p.is_ok()) {
          mine = *p;
        } else {
          local = p.status();
        }
      }
      ZINF_ASSIGN_OR_RETURN(std::vector<double> all, agreement.exchange_partials(mine));
      for (double p : all) {
        norm.ok &= !(p < 0);  // the failure sentinel (an overflow's NaN or inf is not one)
        norm.sum_squares += p;
      }
    }
  }
  norm.ok &= local.is_ok();
  return norm;
}

// The classic walk, or behind step() the walk handed to the worker (one rank: nothing to agree
// on before it runs).
Status Engine::Impl::update(StepFacts& f, const StepInfo& info) {
  const kernels::AdamStepArgs args{
      .step = e.steps + 1, .grad_scale = optimizer.combined_scale() * clip_coef(info.grad_norm)};
  if (!e.updates.behind) return optimizer.update(args, f.writeback);
  optimizer.start_behind(args);
  return Status::ok();
}

// Every rank's outcome: a failure anywhere fails the step everywhere, and the next step()
// finishes it. A non-finite gradient met by a fused update: the units updated before it cannot
// be taken back, so no retry can make this step whole; every rank stops.
Status Engine::Impl::agree_outcome(StepFacts& f) {
  const bool fatal = f.local.code() == ErrorCode::kNonFinite && e.updates.fused;
  bool fatal_elsewhere = false;
  Status agreed = agreement.agree(std::move(f.local), fatal, &fatal_elsewhere);
  if (!agreed.is_ok()) {
    e.update_incomplete = true;
    if (fatal || fatal_elsewhere || agreed.code() == ErrorCode::kNonFinite) e.fatal = agreed;
    return agreed;
  }
  e.update_incomplete = false;
  return Status::ok();
}

// Global-norm clipping: the factor the gradients are multiplied by (1 when not clipped).
float Engine::Impl::clip_coef(double grad_norm) const {
  if (e.s.gradient_clipping <= 0 || grad_norm <= e.s.gradient_clipping) return 1.0f;
  return static_cast<float>(e.s.gradient_clipping / (grad_norm + 1e-6));
}

std::string Engine::Impl::skip_reason(const StepFacts& f) const {
  if (f.poisoned) {
    return fmt::format(
        "unit {} has a non-finite gradient (met by the step's first update, fused into the "
        "backward pass, before any other)",
        e.units[*f.poisoned].name);
  }
  return fmt::format("the global gradient norm is {}",
                     std::isnan(f.norm.sum_squares) ? "NaN" : "infinite");
}

// A non-finite gradient norm on some rank: no update, the gradients are dropped; fp16's loss
// scale goes down. The skip counts towards max_nonfinite_steps unless the scale can still go
// down; that many in a row fail the step, naming it.
Status Engine::Impl::skip(StepInfo& info, const std::string& what) {
  agreed_norm_.reset();
  nonfinite_unit_.reset();
  const bool counts = scaler.at_floor();
  info.skipped = true;
  scaler.on_overflow();
  optimizer.discard();
  info.loss_scale = scaler.scale();
  info.step = e.steps;
  ++skipped_steps;
  if (counts) ++nonfinite_in_a_row;
  info.skipped_steps = skipped_steps;
  info.nonfinite_in_a_row = nonfinite_in_a_row;
  log::warn_once("engine:nonfinite", fmt::format("step {}: {}; the step is skipped (reported "
                                                 "once; StepInfo::skipped_steps counts them)",
                                                 step_calls, what));
  const uint64_t limit = e.s.max_nonfinite_steps;
  if (limit == 0 || nonfinite_in_a_row < limit) return Status::ok();
  return make_error(
      ErrorCode::kNonFinite,
      "step {}: {} in {} steps in a row "
      "(max_nonfinite_steps = {}{}); stopping: the parameters are those of optimizer step {} "
      "(lower the learning rate, check the data or the loss scale, or resume from a checkpoint)",
      step_calls, what, nonfinite_in_a_row, limit,
      scaler.checks_overflow() ? ", counted at the minimum fp16 loss scale" : "", e.steps);
}

// Updated on every rank: the next step starts from here.
Status Engine::Impl::commit(StepInfo& info) {
  agreed_norm_.reset();
  ++e.steps;
  nonfinite_in_a_row = 0;
  info.skipped_steps = skipped_steps;
  optimizer.commit();
  Status shared;
  if (e.policy.share_updated_params) shared = gatherer.share_updated_parameters();
  scaler.on_good_step();
  info.step = e.steps;
  info.loss_scale = scaler.scale();
  // An update running behind waits for its own write-backs (BehindWalk::wait() reports them).
  Status end = optimizer.behind().pending() ? Status() : e.finish_evictions();
  optimizer.after_commit();
  return shared.is_ok() ? end : shared;
}

}  // namespace zinf
