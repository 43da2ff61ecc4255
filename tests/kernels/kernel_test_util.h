// Helpers shared by the CPU kernel tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/kernels/cpu_features.h"

namespace zinf::kernels::ktest {

// Every path this CPU can run, the scalar one first.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

inline std::string isa_str(Isa isa) { return std::string(isa_name(isa)); }

// Same bits, or both NaN (NaN payloads are not part of the contract).
inline bool same_f32(float a, float b) {
  return f32_bits(a) == f32_bits(b) || (std::isnan(a) && std::isnan(b));
}
inline bool same_u16(uint16_t a, uint16_t b, DType d) {
  if (a == b) return true;
  const float fa = d == DType::kBF16 ? bf16_to_f32(a) : f16_to_f32(a);
  const float fb = d == DType::kBF16 ? bf16_to_f32(b) : f16_to_f32(b);
  return std::isnan(fa) && std::isnan(fb);
}

// Gradients of one dtype in a byte buffer (with room for a misaligned start).
struct GradBuffer {
  DType dtype;
  std::vector<uint8_t> bytes;
  GradBuffer(DType d, size_t n) : dtype(d), bytes(n * dtype_size(d) + 64) {}
  void* at(size_t i) { return bytes.data() + i * dtype_size(dtype); }
  const void* at(size_t i) const { return bytes.data() + i * dtype_size(dtype); }
  void set(size_t i, float x) {
    if (dtype == DType::kF32) {
      std::memcpy(at(i), &x, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
      std::memcpy(at(i), &h, 2);
    }
  }
  void set_bits(size_t i, uint32_t bits) {
    if (dtype == DType::kF32) {
      std::memcpy(at(i), &bits, 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(bits);
      std::memcpy(at(i), &h, 2);
    }
  }
  float get(size_t i) const {
    if (dtype == DType::kF32) {
      float x;
      std::memcpy(&x, at(i), 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, at(i), 2);
    return dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
};

// Values spread over several decades, both signs: x * 10^e, e uniform in [lo, hi].
inline float spread(std::mt19937& rng, float lo_exp, float hi_exp) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), exp10(lo_exp, hi_exp);
  return unit(rng) * std::pow(10.0f, exp10(rng));
}

}  // namespace zinf::kernels::ktest
