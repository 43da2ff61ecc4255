// Creating a communicator without knowing which backends this build has.
#pragma once

#include <memory>

#include "zinf/comm/communicator.h"
#include "zinf/comm/env.h"

namespace zinf::comm {

// Whether `backend` was compiled into this build (local always is).
bool backend_available(Backend backend);
// The backends compiled in, and whether a GPU is visible (asks the CUDA runtime when NCCL is in).
BackendsBuilt backends_built();

// The process's communicator for `config`: MPI (rank and world checked against MPI's own), or
// NCCL on device local_rank (bootstrapped through MPI under mpirun, else through the TCP store
// at master_addr:store_port that rank 0 serves), or Gloo (through that same store). The local
// backend is threads, not processes: a config for it with world_size > 1 is refused here (use
// make_local_group); world_size 1 gives a one-rank local communicator.
Result<std::unique_ptr<Communicator>> create_communicator(const CommConfig& config);

// parse_comm_env(std::getenv) then create_communicator.
Result<CommConfig> comm_config_from_env();
// parse_comm_timeout(std::getenv): ZINF_COMM_TIMEOUT, or the default.
Result<std::chrono::milliseconds> comm_timeout_from_env();
Result<std::unique_ptr<Communicator>> from_env();

}  // namespace zinf::comm
