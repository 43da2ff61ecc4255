// Compiled with -fmad=false (CMakeLists.txt) so no add is fused with the scaling multiply: the
// arithmetic stays reduce_element's, as on the CPU.
#include <algorithm>

#include "nccl_reduce.h"
#include "zinf/comm/reduce_math.h"

namespace zinf::comm::nccl_detail {
namespace {

struct StagedChunks {
  const unsigned char* base;
  size_t chunk_bytes;
  __host__ __device__ const void* operator()(int j) const { return base + j * chunk_bytes; }
};

__global__ void rank_order_reduce_kernel(void* dst, StagedChunks chunks, size_t count, int nsrc,
                                         DType dtype, float scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    reduce_element(dst, chunks, nsrc, i, dtype, scale);
  }
}

}  // namespace

cudaError_t launch_rank_order_reduce(void* dst, const void* staging, size_t chunk_bytes,
                                     size_t count, int nsrc, DType dtype, float scale,
                                     cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((count + kThreads - 1) / kThreads, 65535));
  rank_order_reduce_kernel<<<blocks, kThreads, 0, stream>>>(
      dst, StagedChunks{static_cast<const unsigned char*>(staging), chunk_bytes}, count, nsrc,
      dtype, scale);
  return cudaGetLastError();
}

}  // namespace zinf::comm::nccl_detail
