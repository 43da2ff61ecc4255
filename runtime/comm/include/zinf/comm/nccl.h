// The NCCL backend: one GPU per rank; buffers are device pointers on options.device.
//
// Compiled whenever CUDA is on. The communicator is created non-blocking (ncclConfig_t
// blocking = 0) and every wait polls against the timeout, aborting the NCCL communicator when it
// runs out. Operations run on a CUDA stream of the backend's own; the Work completes when the
// stream has finished them. Buffers must be ready when an operation is issued: synchronise the
// stream that produced them first (a later change bridges Work to the memory tier's Stream/Event).
// A job makes one NCCL communicator through from_env(); more need make_nccl_communicator with a
// share_unique_id of their own (another store key or port).
//
// Determinism: reductions do not use NCCL's reduce (its order follows the topology). Each rank
// receives its chunk from every peer (grouped ncclSend/ncclRecv, the same bytes a ring moves) and
// a kernel sums them in rank order with the same element function as the CPU backends, so GPU
// results equal the local and MPI backends bit for bit. all_gather and broadcast are NCCL's.
#pragma once

#include <chrono>
#include <memory>

#include "zinf/comm/communicator.h"
#include "zinf/comm/store.h"

namespace zinf::comm {

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  int device = 0;  // CUDA device index, usually LOCAL_RANK
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Carries rank 0's ncclUniqueId to the others: store_share_from_rank0() or
  // mpi_share_from_rank0(). May be empty when world_size == 1.
  ShareFromRank0 share_unique_id;
};

// The number of CUDA devices; 0 when there is no GPU or no driver.
int cuda_device_count();

// kUnavailable when there is no usable device.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(NcclOptions options);

}  // namespace zinf::comm
