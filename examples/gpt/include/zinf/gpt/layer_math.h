// Element functions of the GPT's layers shared by the CPU loops (layers.cc) and the CUDA kernels
// (cuda_layers.cu): one copy of the math, so both compute the same IEEE operations
// in the same order. Plain multiplies and adds only: the CPU build contracts none of them (no FMA
// in baseline x86-64) and cuda_layers.cu is compiled with --fmad=false, so the GELU of a value
// has the same bits on both.
#pragma once

#include <cstdint>
#include <cstring>
#if __cplusplus >= 202002L
#include <bit>
#endif

#include "zinf/core/dtype.h"  // ZINF_HOST_DEVICE

namespace zinf::gpt {

inline constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluCubic = 0.044715f;

ZINF_HOST_DEVICE inline float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif __cplusplus >= 202002L
  return std::bit_cast<float>(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// exp(x) without a libm call or a branch, so that GCC vectorises the loops that call it: x = n
// ln2 + r with |r| <= ln2 / 2 (Cody-Waite, ln2 in two parts), exp(r) by its Taylor polynomial of
// degree 7 (truncation below 1e-8 relative), times 2^n built in the exponent bits. Relative
// error about 2e-7 against libm on [-87, 88]. Outside, the exponent is clamped to [-126, 127]:
// the result saturates to at most 2^-126 below (which vanishes in 1 + exp) and to at least 2^126
// above; NaN stays NaN. The clamp is on n, not on x: clamping x made GCC split the loop into
// cases and run four times slower.
ZINF_HOST_DEVICE inline float exp_vectorizable(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // 16 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.428606765330187045e-06f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  float n_clamped = n < -126.0f ? -126.0f : n;
  n_clamped = n_clamped > 127.0f ? 127.0f : n_clamped;
  const auto exponent = static_cast<uint32_t>(static_cast<int32_t>(n_clamped) + 127) << 23;
  return p * float_from_bits(exponent);
}

// GELU, tanh approximation (GPT-2), as 0.5 x (1 + tanh(u)) = x * sigmoid(2u): one exp per element
// instead of a tanh (glibc computes tanhf through expm1f, which cost a quarter of a training
// step). exp(-2u) saturates for very negative u, giving sigmoid 0 as it should.
ZINF_HOST_DEVICE inline float gelu_value(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  return v / (1.0f + exp_vectorizable(-2.0f * u));
}

// dy * gelu'(v). With s = sigmoid(2u): gelu' = s + 2 v s (1 - s) du/dv (as 1 - tanh^2(u) =
// 4 s (1 - s)).
ZINF_HOST_DEVICE inline float gelu_gradient(float dy, float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  const float s = 1.0f / (1.0f + exp_vectorizable(-2.0f * u));
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
  return dy * (s + 2.0f * v * s * (1.0f - s) * du);
}

}  // namespace zinf::gpt
