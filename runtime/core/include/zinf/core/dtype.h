// Element types of working parameters, gradients and collectives, and the scalar conversions
// every layer agrees on: fp32 -> bf16/fp16 rounds to nearest even, NaN stays NaN (quiet),
// overflow goes to infinity. Vectorised bulk conversions live in kernels/.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#if defined(__CUDACC__)
#define ZINF_HOST_DEVICE __host__ __device__
#else
#define ZINF_HOST_DEVICE
#endif

namespace zinf {

enum class DType : uint8_t { kF32, kBF16, kF16 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) {
  return t == DType::kF32 ? "fp32" : t == DType::kBF16 ? "bf16" : "fp16";
}
constexpr std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "float32" || s == "f32") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "float16" || s == "f16" || s == "half") return DType::kF16;
  return std::nullopt;
}

ZINF_HOST_DEVICE inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
ZINF_HOST_DEVICE inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

ZINF_HOST_DEVICE inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
ZINF_HOST_DEVICE inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t{h} << 16); }

ZINF_HOST_DEVICE inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal fp16 (2^-14): subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to zero
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150); fp16 subnormal unit is 2^-24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits, nearest even
  uint32_t h = ((rounded >> 13) - ((127 - 15) << 10));
  return static_cast<uint16_t>(sign | h);
}

ZINF_HOST_DEVICE inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    // subnormal: mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

}  // namespace zinf
