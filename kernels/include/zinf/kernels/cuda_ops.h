// The CUDA kernels behind CudaDevice's operations (runtime/memory), as plain C++ entry points: no
// CUDA headers here, a stream is passed as its cudaStream_t cast to void*. Each launcher enqueues
// its kernel on the stream and returns an empty string, or what failed to launch.
//
// Every kernel computes what the CPU backend computes for the same operation, element by element:
// the same conversions (dtype.h), the same Adam element function (adam_math.h), the same
// deterministic blocks and lanes for the sum of squares (cpu_adam.h), so results are bit-equal
// (tests/gpu compares them with the CPU device).
#pragma once

#include <cstdint>
#include <string>

#include "zinf/core/dtype.h"
#include "zinf/kernels/adam_math.h"

namespace zinf::kernels::cuda {

// dst[i] = value, converted to dtype.
std::string fill(void* stream, void* dst, DType dtype, uint64_t n, float value);
// acc[i] = (overwrite ? 0.0f : acc[i]) + (float)src[i].
std::string accumulate(void* stream, float* acc, const void* src, DType src_dtype, uint64_t n,
                       bool overwrite);
// dst[i] = (float)src[i] converted to dst_dtype (round to nearest even).
std::string cast(void* stream, void* dst, DType dst_dtype, const void* src, DType src_dtype,
                 uint64_t n);
// x[i] = x[i] * factor in x's dtype; *flag (device-visible memory) is set to 1 when some stored
// result is inf or NaN (never cleared here).
std::string scale(void* stream, void* x, DType dtype, uint64_t n, float factor, int* flag);
// block_sums[b] (device-visible memory) = the sum of squares of block b of kSumSquaresBlockElems
// elements, each (double)(float)x[i] * factor, accumulated as the CPU accumulates it: element i
// into lane i % 16 with a double FMA, the 16 lanes added as the same fixed tree.
std::string sum_squares_blocks(void* stream, const void* x, DType dtype, uint64_t n, float factor,
                               double* block_sums);
// One Adam/AdamW step (adam_element) over n elements; param_copy (optional) receives the updated
// parameters in copy_dtype; *nonfinite (device-visible, optional) is set to 1 when some scaled
// gradient was inf or NaN.
std::string adam(void* stream, const AdamCoeffs& coeffs, float* param, float* m, float* v,
                 const void* grad, DType grad_dtype, void* param_copy, DType copy_dtype, uint64_t n,
                 int* nonfinite);

}  // namespace zinf::kernels::cuda
