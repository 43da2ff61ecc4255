// Bytes of Adam's state per parameter element, beside the working parameters: the fp32 moments m
// and v, the fp32 master copy when the working dtype is 16-bit (fp32 parameters are their own
// master) and, where the caller counts it with them, the fp32 gradient accumulator. fp32: 8, or
// 12 with the accumulator; bf16/fp16: 12, or 16 (the ZeRO paper's 12 bytes of optimizer state
// plus the accumulator). Every size, budget and traffic figure built on this count calls these.
#pragma once

#include <cstdint>

#include "zinf/core/dtype.h"

namespace zinf {

// The fp32 gradient accumulator, per element.
inline constexpr uint64_t kAccumulatorBytesPerElement = 4;

enum class Accumulator { kExcluded, kIncluded };

constexpr uint64_t optimizer_state_bytes_per_element(DType working, Accumulator accumulator) {
  const uint64_t moments = 8;                              // m and v, fp32
  const uint64_t master = working == DType::kF32 ? 0 : 4;  // fp32 master of 16-bit parameters
  return moments + master +
         (accumulator == Accumulator::kIncluded ? kAccumulatorBytesPerElement : 0);
}

static_assert(optimizer_state_bytes_per_element(DType::kF32, Accumulator::kIncluded) == 12);
static_assert(optimizer_state_bytes_per_element(DType::kBF16, Accumulator::kIncluded) == 16);
static_assert(optimizer_state_bytes_per_element(DType::kF16, Accumulator::kExcluded) == 12);
static_assert(optimizer_state_bytes_per_element(DType::kF32, Accumulator::kExcluded) == 8);

}  // namespace zinf
