// The Adam/AdamW update of one element: the single copy of the optimizer math.
//
// adam_update() is written once over an arithmetic policy `Math` (mul, fma, sqrt, div) and a lane
// type `T`: the scalar loop, the SIMD loops (T = __m256, __m512 with their own Math) and the CUDA
// kernel (T = float, ScalarMath on the device) all instantiate this one function, so they perform
// the same IEEE operations in the same order and give the same bits.
//
// Bit-exactness rules, relied on by the whole engine (ZeRO stages split shards at different
// offsets and must still give identical parameters):
//  - Every operation is a correctly rounded IEEE binary32 operation: multiply, fused multiply-add,
//    square root, divide. There is no plain addition anywhere, so a compiler cannot contract a
//    product and a sum into an FMA behind our back (-ffp-contract makes no difference).
//  - Never compile callers with -ffast-math (or -freciprocal-math, -funsafe-math-optimizations)
//    and never run them with FTZ/DAZ set in MXCSR; CUDA callers must not use --use_fast_math
//    (the device branch below uses the _rn intrinsics, which no flag changes).
//  - NaN payloads are not part of the contract: a NaN stays a NaN, nothing more.
#pragma once

#include <cmath>
#include <cstdint>

#include "zinf/core/dtype.h"

namespace zinf::kernels {

enum class WeightDecayMode : uint8_t {
  kDecoupled,  // AdamW (Loshchilov & Hutter): param *= 1 - lr * weight_decay, before the update
  kL2,         // classic Adam with L2: grad += weight_decay * param, before the moments
};

// Hyper-parameters; the defaults are PyTorch's (torch.optim.AdamW when weight_decay != 0).
struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kDecoupled;
  bool bias_correction = true;
};

struct AdamStepArgs {
  int64_t step = 1;         // 1-based index of this update (bias correction uses it)
  float grad_scale = 1.0f;  // every gradient is multiplied by it first: 1/loss_scale * clip coef
};

// The per-step scalars adam_update() consumes, rounded once to fp32 (see adam_coeffs()).
// T is float, or a SIMD vector holding the same value in every lane.
template <class T>
struct BasicAdamCoeffs {
  T grad_scale;                 // AdamStepArgs::grad_scale
  T l2_weight_decay;            // weight_decay in kL2 mode, else 0
  T beta1, one_minus_beta1;     // beta1, 1 - beta1
  T beta2, one_minus_beta2;     // beta2, 1 - beta2
  T eps;                        // added to the bias-corrected sqrt(v)
  T inv_sqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step), or 1
  T param_decay;                // 1 - lr * weight_decay in kDecoupled mode, else 1
  T neg_step_size;              // -lr / (1 - beta1^step), or -lr
};
using AdamCoeffs = BasicAdamCoeffs<float>;

// Derived in double from the fp32 hyper-parameters, then rounded to fp32 once each. Requires
// step >= 1 when bias_correction is on (step 0 would divide by zero).
inline AdamCoeffs adam_coeffs(const AdamConfig& cfg, const AdamStepArgs& args) {
  const double lr = cfg.lr, beta1 = cfg.beta1, beta2 = cfg.beta2, wd = cfg.weight_decay;
  const double step = static_cast<double>(args.step);
  const double bc1 = cfg.bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = cfg.bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  const bool decoupled = cfg.weight_decay_mode == WeightDecayMode::kDecoupled;
  AdamCoeffs c;  // (no designated initializers: this header also compiles as CUDA C++17)
  c.grad_scale = args.grad_scale;
  c.l2_weight_decay = decoupled ? 0.0f : cfg.weight_decay;
  c.beta1 = cfg.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = cfg.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = cfg.eps;
  c.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.param_decay = decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  c.neg_step_size = static_cast<float>(-lr / bc1);
  return c;
}

// The arithmetic policy for T = float: correctly rounded binary32 on host and device.
struct ScalarMath {
  ZINF_HOST_DEVICE static float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  ZINF_HOST_DEVICE static float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);  // an fmaf call where the target has no FMA: still exact
#endif
  }
  ZINF_HOST_DEVICE static float sqrt(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return __builtin_sqrtf(a);
#endif
  }
  ZINF_HOST_DEVICE static float div(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
};

// One Adam/AdamW update of param, m and v from the raw fp32 gradient `grad`:
//
//   g      = grad * grad_scale
//   g      = g + l2_weight_decay * param                   (kL2; l2_weight_decay = 0 otherwise)
//   m      = beta1 * m + (1 - beta1) * g
//   v      = beta2 * v + (1 - beta2) * g * g
//   denom  = sqrt(v) / sqrt(1 - beta2^t) + eps             (eps outside the sqrt, after the
//                                                           bias correction: PyTorch, DeepSpeed)
//   param  = param * (1 - lr * weight_decay)               (kDecoupled; the factor is 1 otherwise)
//   param  = param - lr / (1 - beta1^t) * m / denom
//
// evaluated exactly as written below (each line one or two correctly rounded operations; the
// division by sqrt(bias correction) is a multiplication by its fp32 reciprocal, as in DeepSpeed).
// Returns the scaled gradient (before the L2 term) so callers can check it for inf/NaN.
template <class Math, class T>
ZINF_HOST_DEVICE inline T adam_update(const BasicAdamCoeffs<T>& c, T grad, T& param, T& m, T& v) {
  const T g_scaled = Math::mul(grad, c.grad_scale);
  const T g = Math::fma(c.l2_weight_decay, param, g_scaled);
  m = Math::fma(c.beta1, m, Math::mul(c.one_minus_beta1, g));
  v = Math::fma(c.beta2, v, Math::mul(c.one_minus_beta2, Math::mul(g, g)));
  const T denom = Math::fma(Math::sqrt(v), c.inv_sqrt_bias_correction2, c.eps);
  param = Math::fma(c.neg_step_size, Math::div(m, denom), Math::mul(param, c.param_decay));
  return g_scaled;
}

ZINF_HOST_DEVICE inline bool is_finite_f32(float x) {
  return (f32_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// The element function of the CPU scalar path, the reference of the SIMD paths and the body of
// the CUDA kernel. Returns false when the scaled gradient was inf or NaN (the update is still
// applied: see cpu_adam.h for the policy).
ZINF_HOST_DEVICE inline bool adam_element(const AdamCoeffs& c, float grad, float& param, float& m,
                                          float& v) {
  return is_finite_f32(adam_update<ScalarMath>(c, grad, param, m, v));
}

}  // namespace zinf::kernels
