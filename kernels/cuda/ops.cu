#include <cuda_runtime.h>

#include "zinf/kernels/cpu_adam.h"
#include "zinf/kernels/cuda_ops.h"

namespace zinf::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLanes = 16;  // as the CPU's sum of squares (kernel_table.h kSumSquaresLanes)

__device__ inline float load_f32(const void* x, DType d, uint64_t i) {
  switch (d) {
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(x)[i]);
    default:
      return static_cast<const float*>(x)[i];
  }
}

// Stores v converted to d; returns the value stored, as a float.
__device__ inline float store_f32(void* x, DType d, uint64_t i, float v) {
  switch (d) {
    case DType::kBF16: {
      const uint16_t h = f32_to_bf16(v);
      static_cast<uint16_t*>(x)[i] = h;
      return bf16_to_f32(h);
    }
    case DType::kF16: {
      const uint16_t h = f32_to_f16(v);
      static_cast<uint16_t*>(x)[i] = h;
      return f16_to_f32(h);
    }
    default:
      static_cast<float*>(x)[i] = v;
      return v;
  }
}

__device__ inline uint64_t index() {
  return blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
}

__global__ void fill_kernel(void* dst, DType d, uint64_t n, float value) {
  const uint64_t i = index();
  if (i < n) store_f32(dst, d, i, value);
}

__global__ void accumulate_kernel(float* acc, const void* src, DType d, uint64_t n,
                                  bool overwrite) {
  const uint64_t i = index();
  if (i < n) acc[i] = __fadd_rn(overwrite ? 0.0f : acc[i], load_f32(src, d, i));
}

__global__ void cast_kernel(void* dst, DType dd, const void* src, DType sd, uint64_t n) {
  const uint64_t i = index();
  if (i < n) store_f32(dst, dd, i, load_f32(src, sd, i));
}

__global__ void scale_kernel(void* x, DType d, uint64_t n, float factor, int* flag) {
  const uint64_t i = index();
  if (i >= n) return;
  const float stored = store_f32(x, d, i, __fmul_rn(load_f32(x, d, i), factor));
  if (flag != nullptr && !is_finite_f32(stored)) *flag = 1;
}

// One thread block of kLanes threads per block of kSumSquaresBlockElems elements.
__global__ void sum_squares_kernel(const void* x, DType d, uint64_t n, double scale,
                                   double* block_sums) {
  __shared__ double lanes[kLanes];
  const uint64_t begin = blockIdx.x * static_cast<uint64_t>(kSumSquaresBlockElems);
  const uint64_t end = min(n, begin + kSumSquaresBlockElems);
  double lane = 0.0;
  for (uint64_t i = begin + threadIdx.x; i < end; i += kLanes) {
    const double v = static_cast<double>(load_f32(x, d, i)) * scale;  // exact: 24 x 24 bits
    lane = __fma_rn(v, v, lane);
  }
  lanes[threadIdx.x] = lane;
  __syncthreads();
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    if (threadIdx.x < w) lanes[threadIdx.x] = __dadd_rn(lanes[threadIdx.x], lanes[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) block_sums[blockIdx.x] = lanes[0];
}

__global__ void adam_kernel(AdamCoeffs c, float* param, float* m, float* v, const void* grad,
                            DType gd, void* copy, DType cd, uint64_t n, int* nonfinite) {
  const uint64_t i = index();
  if (i >= n) return;
  float p = param[i], mi = m[i], vi = v[i];
  const bool finite = adam_element(c, load_f32(grad, gd, i), p, mi, vi);
  param[i] = p;
  m[i] = mi;
  v[i] = vi;
  if (copy != nullptr) store_f32(copy, cd, i, p);
  if (!finite && nonfinite != nullptr) *nonfinite = 1;
}

unsigned blocks_for(uint64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

std::string launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(err);
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

std::string fill(void* stream, void* dst, DType dtype, uint64_t n, float value) {
  if (n == 0) return {};
  fill_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(dst, dtype, n, value);
  return launched("fill kernel");
}

std::string accumulate(void* stream, float* acc, const void* src, DType src_dtype, uint64_t n,
                       bool overwrite) {
  if (n == 0) return {};
  accumulate_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(acc, src, src_dtype, n,
                                                                       overwrite);
  return launched("accumulate kernel");
}

std::string cast(void* stream, void* dst, DType dst_dtype, const void* src, DType src_dtype,
                 uint64_t n) {
  if (n == 0) return {};
  cast_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(dst, dst_dtype, src, src_dtype, n);
  return launched("cast kernel");
}

std::string scale(void* stream, void* x, DType dtype, uint64_t n, float factor, int* flag) {
  if (n == 0) return {};
  scale_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(x, dtype, n, factor, flag);
  return launched("scale kernel");
}

std::string sum_squares_blocks(void* stream, const void* x, DType dtype, uint64_t n, float factor,
                               double* block_sums) {
  const uint64_t blocks = sum_squares_block_count(n);
  if (blocks == 0) return {};
  sum_squares_kernel<<<static_cast<unsigned>(blocks), kLanes, 0, as_stream(stream)>>>(
      x, dtype, n, static_cast<double>(factor), block_sums);
  return launched("sum of squares kernel");
}

std::string adam(void* stream, const AdamCoeffs& coeffs, float* param, float* m, float* v,
                 const void* grad, DType grad_dtype, void* param_copy, DType copy_dtype, uint64_t n,
                 int* nonfinite) {
  if (n == 0) return {};
  adam_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(
      coeffs, param, m, v, grad, grad_dtype, param_copy, copy_dtype, n, nonfinite);
  return launched("adam kernel");
}

}  // namespace zinf::kernels::cuda
