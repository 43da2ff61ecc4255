#include "zinf/core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace zinf {
namespace {

// Reference: pick the nearest representable value among all 65536 codes (ties to even code).
template <typename ToF32>
uint16_t nearest_code(float x, ToF32 to_f32) {
  double best_err = INFINITY;
  uint16_t best = 0;
  for (uint32_t c = 0; c < 65536; ++c) {
    float y = to_f32(static_cast<uint16_t>(c));
    if (std::isnan(y)) continue;
    double err = std::fabs(static_cast<double>(y) - static_cast<double>(x));
    if (err < best_err || (err == best_err && (c & 1) == 0 && std::signbit(y) == std::signbit(x))) {
      best_err = err;
      best = static_cast<uint16_t>(c);
    }
  }
  return best;
}

TEST(DType, Bf16RoundsToNearestEvenAndKeepsNan) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(3.0f)), 3.0f);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0)
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(bits_f32(0x7f800001u)))));  // signalling NaN
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(INFINITY)), INFINITY);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(3.4e38f)), INFINITY);  // overflow rounds up to inf
}

TEST(DType, F16MatchesExhaustiveNearestOnSamples) {
  uint32_t state = 12345;
  for (int i = 0; i < 3000; ++i) {
    state = state * 1664525u + 1013904223u;
    // exponents spanning subnormals to overflow of fp16
    float x = std::ldexp(static_cast<float>(state % 1000000) / 1000000.0f + 0.5f,
                         static_cast<int>(state >> 27) - 26);
    if (state & 0x10) x = -x;
    uint16_t got = f32_to_f16(x);
    if (std::fabs(x) >= 65520.0f) {
      EXPECT_TRUE(std::isinf(f16_to_f32(got))) << x;
      continue;
    }
    EXPECT_EQ(got, nearest_code(x, f16_to_f32)) << "x=" << x;
  }
}

TEST(DType, F16RoundTripOfEveryCode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    float f = f16_to_f32(static_cast<uint16_t>(c));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
    } else {
      EXPECT_EQ(f32_to_f16(f), c) << std::hex << c;
    }
  }
}

TEST(DType, Bf16RoundTripOfEveryCode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    float f = bf16_to_f32(static_cast<uint16_t>(c));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    } else {
      EXPECT_EQ(f32_to_bf16(f), c) << std::hex << c;
    }
  }
}

}  // namespace
}  // namespace zinf
