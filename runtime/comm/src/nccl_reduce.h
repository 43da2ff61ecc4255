// The rank-order reduction kernel of the NCCL backend (nccl_reduce.cu), callable from C++.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "zinf/core/dtype.h"

namespace zinf::comm::nccl_detail {

// dst[i] = reduce_element over the `nsrc` chunks of `staging` (chunk j at staging + j *
// chunk_bytes), for i < count, on `stream`.
cudaError_t launch_rank_order_reduce(void* dst, const void* staging, size_t chunk_bytes,
                                     size_t count, int nsrc, DType dtype, float scale,
                                     cudaStream_t stream);

}  // namespace zinf::comm::nccl_detail
