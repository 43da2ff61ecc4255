// Which backend, which rank, how many: read from the launcher's environment.
//
//   ZINF_COMM            local | mpi | nccl | gloo (default: what the launcher implies, below)
//   ZINF_COMM_TIMEOUT    seconds, > 0 (default 300): bound on every wait for a peer, in every
//                        backend (local groups for --ranks included) and in the store rendezvous
//   ZINF_STORE_BIND      address rank 0's TCP store binds to (default MASTER_ADDR when it is
//                        set, else 127.0.0.1)
//   ZINF_STORE_PORT      port rank 0's TCP store listens on (default MASTER_PORT; MASTER_PORT + 1
//                        under torchrun, whose agent serves its own store on MASTER_PORT and says
//                        so with TORCHELASTIC_USE_AGENT_STORE=True)
//   torchrun:  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (default 127.0.0.1), MASTER_PORT (29500)
//   OpenMPI:   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   Slurm:     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//
// Rank and world come from the first family that is present, in that order (torchrun, OpenMPI,
// Slurm); none present means one rank. Without ZINF_COMM, launched processes take the backends in
// order: nccl when it is built and a GPU is visible, else mpi under mpirun or srun;
// a torchrun-style world without a GPU is gloo (local for a world of one); no launcher at all is
// one local rank. GLOO_SOCKET_IFNAME names the interface Gloo listens on (gloo.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "zinf/comm/communicator.h"

namespace zinf::comm {

enum class EnvSource : uint8_t { kNone, kTorchrun, kOpenMpi, kSlurm };
std::string_view env_source_name(EnvSource source);

struct CommConfig {
  Backend backend = Backend::kLocal;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  uint16_t store_port = 29500;  // where rank 0's TCP store listens (ZINF_STORE_PORT, above)
  std::string store_bind;       // what rank 0's store binds to; empty: 127.0.0.1
  std::string gloo_iface;       // GLOO_SOCKET_IFNAME; empty: the address that routes to master_addr
  std::chrono::milliseconds timeout = kDefaultTimeout;
  EnvSource source = EnvSource::kNone;
  bool backend_explicit = false;  // ZINF_COMM was set
};

// Which backends this build has, and whether NCCL has a GPU to run on: the implicit choice.
struct BackendsBuilt {
  bool mpi = false;
  bool nccl = false;
  bool gloo = false;
  bool gpus = false;  // at least one CUDA device is visible
};

using GetEnv = std::function<const char*(const char* name)>;

// Parses the variables above through `getenv`. Errors name the variable and its value.
Result<CommConfig> parse_comm_env(const GetEnv& getenv, BackendsBuilt built);

// ZINF_COMM_TIMEOUT alone (kDefaultTimeout when unset): the one timeout setting, for callers
// that build their communicators themselves (a local group for --ranks, MPI under mpirun).
Result<std::chrono::milliseconds> parse_comm_timeout(const GetEnv& getenv);

}  // namespace zinf::comm
