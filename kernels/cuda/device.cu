#include <cuda_runtime.h>

#include "zinf/kernels/cuda_device.h"

namespace zinf::kernels::cuda {
namespace {

__global__ void fill_kernel(float* out, size_t n, float value) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = value;
}

}  // namespace

int device_count() {
  // Without a GPU cudaGetDeviceCount fails (insufficient driver, or the stub libcuda) and may
  // leave the count unset: start from 0 and treat any error as "no device".
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  return count;
}

std::string fill_roundtrip(float* host, size_t n, float value) {
  float* dev = nullptr;
  cudaError_t err = cudaMalloc(&dev, n * sizeof(float));
  if (err != cudaSuccess) return std::string("cudaMalloc: ") + cudaGetErrorString(err);
  unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  fill_kernel<<<blocks, 256>>>(dev, n, value);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  return err == cudaSuccess ? std::string()
                            : std::string("fill kernel: ") + cudaGetErrorString(err);
}

}  // namespace zinf::kernels::cuda
