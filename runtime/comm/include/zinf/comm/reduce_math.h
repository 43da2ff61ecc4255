// The one element function of every reduction in zinf's communicators: the CPU
// loop (local and MPI backends) and the CUDA kernel (NCCL backend) both call it, so all three
// produce the same bits. Compiles as C++17 for nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/core/dtype.h"

namespace zinf::comm {

ZINF_HOST_DEVICE inline float load_as_f32(const void* base, size_t i, DType dtype) {
  if (dtype == DType::kF32) return static_cast<const float*>(base)[i];
  uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

ZINF_HOST_DEVICE inline void store_from_f32(void* base, size_t i, DType dtype, float value) {
  if (dtype == DType::kF32) {
    static_cast<float*>(base)[i] = value;
  } else {
    static_cast<uint16_t*>(base)[i] =
        dtype == DType::kBF16 ? f32_to_bf16(value) : f32_to_f16(value);
  }
}

// Element i of a reduction over `nsrc` contributions, source j at srcs(j): fp32 sum in rank order
// 0, 1, ..., nsrc-1, then scaled by `scale` (1.0f for a sum, 1.0f / world for an average; an exact
// no-op when 1), then converted back once. `Sources` maps a rank to its contribution's base.
template <typename Sources>
ZINF_HOST_DEVICE inline void reduce_element(void* dst, const Sources& srcs, int nsrc, size_t i,
                                            DType dtype, float scale) {
  float acc = load_as_f32(srcs(0), i, dtype);
  for (int j = 1; j < nsrc; ++j) acc = acc + load_as_f32(srcs(j), i, dtype);
  if (scale != 1.0f) acc = acc * scale;
  store_from_f32(dst, i, dtype, acc);
}

}  // namespace zinf::comm
