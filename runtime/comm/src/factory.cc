#include "zinf/comm/factory.h"

#include <cstdlib>

#include "zinf/comm/local.h"
#include "zinf/core/log.h"

#if ZINF_COMM_HAVE_MPI
#include "zinf/comm/mpi.h"
#endif
#if ZINF_COMM_HAVE_NCCL
#include "zinf/comm/nccl.h"
#endif
#if ZINF_COMM_HAVE_GLOO
#include "zinf/comm/gloo.h"
#endif

namespace zinf::comm {

BackendsBuilt backends_built() {
#if ZINF_COMM_HAVE_NCCL
  const bool gpus = cuda_device_count() > 0;
#else
  const bool gpus = false;
#endif
  return BackendsBuilt{.mpi = ZINF_COMM_HAVE_MPI != 0,
                       .nccl = ZINF_COMM_HAVE_NCCL != 0,
                       .gloo = ZINF_COMM_HAVE_GLOO != 0,
                       .gpus = gpus};
}

bool backend_available(Backend backend) {
  switch (backend) {
    case Backend::kLocal:
      return true;
    case Backend::kMpi:
      return backends_built().mpi;
    case Backend::kNccl:
      return backends_built().nccl;
    case Backend::kGloo:
      return backends_built().gloo;
  }
  return false;
}

Result<CommConfig> comm_config_from_env() {
  return parse_comm_env([](const char* name) { return std::getenv(name); }, backends_built());
}

Result<std::chrono::milliseconds> comm_timeout_from_env() {
  return parse_comm_timeout([](const char* name) { return std::getenv(name); });
}

Result<std::unique_ptr<Communicator>> create_communicator(const CommConfig& config) {
  log::debug("comm: backend {}, rank {} of {} (local rank {}), from {}",
             backend_name(config.backend), config.rank, config.world_size, config.local_rank,
             env_source_name(config.source));
  switch (config.backend) {
    case Backend::kLocal: {
      if (config.world_size != 1) {
        return make_error(
            ErrorCode::kInvalidArgument,
            "the local backend runs ranks as threads of one process: a world of {} "
            "processes needs mpi, nccl or gloo (ZINF_COMM), or make_local_group({}) in "
            "one process",
            config.world_size, config.world_size);
      }
      ZINF_ASSIGN_OR_RETURN(auto group, make_local_group(1, {.timeout = config.timeout}));
      return std::move(group[0]);
    }
    case Backend::kMpi: {
#if ZINF_COMM_HAVE_MPI
      ZINF_ASSIGN_OR_RETURN(auto comm, make_mpi_communicator({.timeout = config.timeout}));
      if (config.source != EnvSource::kNone &&
          (comm->rank() != config.rank || comm->world_size() != config.world_size)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "MPI says rank {} of {}, but the {} say rank {} of {}", comm->rank(),
                          comm->world_size(), env_source_name(config.source), config.rank,
                          config.world_size);
      }
      return comm;
#else
      return make_error(ErrorCode::kInvalidArgument, "this build has no MPI backend");
#endif
    }
    case Backend::kNccl: {
#if ZINF_COMM_HAVE_NCCL
      // One GPU per local rank, as the CUDA device picks it (cuda_ordinal).
      const int gpus = cuda_device_count();
      NcclOptions options{.rank = config.rank,
                          .world_size = config.world_size,
                          .device = gpus > 0 ? config.local_rank % gpus : 0,
                          .timeout = config.timeout};
      if (config.world_size > 1) {
#if ZINF_COMM_HAVE_MPI
        if (config.source == EnvSource::kOpenMpi) options.share_unique_id = mpi_share_from_rank0();
#endif
        if (!options.share_unique_id) {
          options.share_unique_id = store_share_from_rank0(
              {.rank = config.rank,
               .world_size = config.world_size,
               .master_addr = config.master_addr,
               .master_port = config.store_port,
               .bind_host =
                   config.store_bind.empty() ? std::string("127.0.0.1") : config.store_bind,
               .key = "zinf/nccl/unique_id",
               .timeout = config.timeout});
        }
      }
      return make_nccl_communicator(std::move(options));
#else
      return make_error(ErrorCode::kInvalidArgument, "this build has no NCCL backend");
#endif
    }
    case Backend::kGloo: {
#if ZINF_COMM_HAVE_GLOO
      return make_gloo_communicator(
          {.rank = config.rank,
           .world_size = config.world_size,
           .master_addr = config.master_addr,
           .master_port = config.store_port,
           .store_bind = config.store_bind.empty() ? std::string("127.0.0.1") : config.store_bind,
           .iface = config.gloo_iface,
           .timeout = config.timeout});
#else
      return make_error(ErrorCode::kInvalidArgument, "this build has no Gloo backend");
#endif
    }
  }
  return make_error(ErrorCode::kInternal, "unknown backend");
}

Result<std::unique_ptr<Communicator>> from_env() {
  ZINF_ASSIGN_OR_RETURN(CommConfig config, comm_config_from_env());
  return create_communicator(config);
}

}  // namespace zinf::comm
