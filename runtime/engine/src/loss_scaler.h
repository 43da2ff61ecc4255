// Loss scaling, as DeepSpeed does it for fp16: a fixed scale (static_loss_scale > 0), or a
// dynamic one that starts at 2^initial_scale_power, is halved (not below min_loss_scale) after
// `hysteresis` overflowing steps, and doubled after loss_scale_window steps without overflow.
// bf16 and fp32 use a scale of 1. Every precision skips a step whose gradient norm is not finite
// (engine.cc); at_floor() says whether such a skip counts towards max_nonfinite_steps.
#pragma once

#include <algorithm>
#include <cmath>

#include "zinf/engine/engine.h"

namespace zinf::engine_detail {

class LossScaler {
 public:
  explicit LossScaler(const EngineSettings& s)
      : dynamic_(s.dtype == DType::kF16 && s.static_loss_scale == 0),
        checks_overflow_(s.dtype == DType::kF16),
        window_(s.loss_scale_window),
        hysteresis_(s.hysteresis),
        min_scale_(s.min_loss_scale),
        hysteresis_left_(s.hysteresis) {
    if (s.static_loss_scale > 0) {
      scale_ = s.static_loss_scale;
    } else if (s.dtype == DType::kF16) {
      scale_ = std::ldexp(1.0f, s.initial_scale_power);
    }
  }

  float scale() const { return scale_; }

  // What a checkpoint keeps, so that a resumed run scales as the uninterrupted one would.
  struct State {
    float scale = 1;
    int good_steps = 0;
    int hysteresis_left = 0;
  };
  State state() const {
    return {.scale = scale_, .good_steps = good_steps_, .hysteresis_left = hysteresis_left_};
  }
  void restore(const State& s) {
    scale_ = s.scale;
    good_steps_ = s.good_steps;
    hysteresis_left_ = s.hysteresis_left;
  }
  // Whether a step must look for non-finite gradients first (and skip itself on one).
  bool checks_overflow() const { return checks_overflow_; }
  // Whether lowering the scale can no longer cure an overflow: no dynamic scaling (fp32, bf16, a
  // static fp16 scale), or the scale is at min_loss_scale.
  bool at_floor() const { return !dynamic_ || scale_ <= min_scale_; }

  // A step skipped for overflow: lower the scale once `hysteresis` overflows have been seen.
  void on_overflow() {
    if (dynamic_ && --hysteresis_left_ <= 0) {
      scale_ = std::max(scale_ / 2, min_scale_);
      hysteresis_left_ = hysteresis_;
    }
    good_steps_ = 0;
  }
  // A step committed without overflow: raise the scale after a window of them.
  void on_good_step() {
    if (dynamic_ && ++good_steps_ >= window_) {
      scale_ *= 2;
      good_steps_ = 0;
    }
  }

 private:
  bool dynamic_;
  bool checks_overflow_;
  int window_;
  int hysteresis_;
  float min_scale_;
  float scale_ = 1;
  int good_steps_ = 0;
  int hysteresis_left_;
};

}  // namespace zinf::engine_detail
