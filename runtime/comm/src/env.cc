#include "zinf/comm/env.h"

#include <charconv>
#include <cmath>
#include <string_view>

namespace zinf::comm {

std::string_view env_source_name(EnvSource source) {
  switch (source) {
    case EnvSource::kNone:
      return "none (one rank)";
    case EnvSource::kTorchrun:
      return "torchrun variables";
    case EnvSource::kOpenMpi:
      return "OpenMPI variables";
    case EnvSource::kSlurm:
      return "Slurm variables";
  }
  return "unknown";
}

namespace {

// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string_view> lookup(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string_view(v);
}

Result<long long> parse_int(const GetEnv& getenv, const char* name, long long min, long long max) {
  std::string_view text = *lookup(getenv, name);
  long long value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return make_error(ErrorCode::kInvalidArgument, "{}='{}' is not an integer", name,
                      std::string(text));
  }
  if (value < min || value > max) {
    return make_error(ErrorCode::kInvalidArgument, "{}={} is out of range [{}, {}]", name, value,
                      min, max);
  }
  return value;
}

struct Family {
  EnvSource source;
  const char* rank;
  const char* world;
  const char* local_rank;
};

constexpr Family kFamilies[] = {
    {EnvSource::kTorchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {EnvSource::kOpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {EnvSource::kSlurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

constexpr long long kMaxWorld = 1 << 24;

}  // namespace

Result<std::chrono::milliseconds> parse_comm_timeout(const GetEnv& getenv) {
  auto text = lookup(getenv, "ZINF_COMM_TIMEOUT");
  if (!text) return kDefaultTimeout;
  double seconds = 0;
  auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
  if (ec != std::errc() || end != text->data() + text->size() || !std::isfinite(seconds) ||
      seconds <= 0 || seconds > 1e7) {
    return make_error(ErrorCode::kInvalidArgument,
                      "ZINF_COMM_TIMEOUT='{}' is not a positive number of seconds",
                      std::string(*text));
  }
  return std::chrono::milliseconds(
      std::max<long long>(1, static_cast<long long>(std::llround(seconds * 1000))));
}

Result<CommConfig> parse_comm_env(const GetEnv& getenv, BackendsBuilt built) {
  CommConfig config;

  // Rank and world: the first family with either variable set.
  for (const Family& f : kFamilies) {
    bool has_rank = lookup(getenv, f.rank).has_value();
    bool has_world = lookup(getenv, f.world).has_value();
    if (!has_rank && !has_world) continue;
    if (!has_world) {
      return make_error(ErrorCode::kInvalidArgument, "{} is set but {} is not ({})", f.rank,
                        f.world, env_source_name(f.source));
    }
    ZINF_ASSIGN_OR_RETURN(long long world, parse_int(getenv, f.world, 0, kMaxWorld));
    if (world == 0) {
      return make_error(ErrorCode::kInvalidArgument, "{}=0: the world size must be at least 1",
                        f.world);
    }
    long long rank = 0;
    if (has_rank) {
      ZINF_ASSIGN_OR_RETURN(rank, parse_int(getenv, f.rank, 0, kMaxWorld));
      if (rank >= world) {
        return make_error(ErrorCode::kInvalidArgument, "{}={} is not below {}={}", f.rank, rank,
                          f.world, world);
      }
    } else if (world > 1) {
      return make_error(ErrorCode::kInvalidArgument, "{}={} is set but {} is not ({})", f.world,
                        world, f.rank, env_source_name(f.source));
    }
    long long local_rank = rank;
    if (lookup(getenv, f.local_rank)) {
      ZINF_ASSIGN_OR_RETURN(local_rank, parse_int(getenv, f.local_rank, 0, kMaxWorld));
    }
    config.rank = static_cast<int>(rank);
    config.world_size = static_cast<int>(world);
    config.local_rank = static_cast<int>(local_rank);
    config.source = f.source;
    break;
  }

  if (auto addr = lookup(getenv, "MASTER_ADDR")) config.master_addr = std::string(*addr);
  if (lookup(getenv, "MASTER_PORT")) {
    ZINF_ASSIGN_OR_RETURN(long long port, parse_int(getenv, "MASTER_PORT", 1, 65535));
    config.master_port = static_cast<uint16_t>(port);
  }
  // zinf's own store: not on a port torchrun's agent already serves its store on.
  config.store_port = config.master_port;
  if (lookup(getenv, "ZINF_STORE_PORT")) {
    ZINF_ASSIGN_OR_RETURN(long long port, parse_int(getenv, "ZINF_STORE_PORT", 1, 65535));
    config.store_port = static_cast<uint16_t>(port);
  } else if (auto agent = lookup(getenv, "TORCHELASTIC_USE_AGENT_STORE");
             agent && (*agent == "True" || *agent == "true" || *agent == "1")) {
    if (config.master_port == 65535) {
      return make_error(ErrorCode::kInvalidArgument,
                        "MASTER_PORT=65535 is taken by torchrun's own store "
                        "(TORCHELASTIC_USE_AGENT_STORE), and zinf's would go on the next port: "
                        "set ZINF_STORE_PORT");
    }
    config.store_port = static_cast<uint16_t>(config.master_port + 1);
  }
  if (auto bind = lookup(getenv, "ZINF_STORE_BIND")) {
    config.store_bind = std::string(*bind);
  } else if (lookup(getenv, "MASTER_ADDR")) {
    config.store_bind = config.master_addr;
  } else {
    config.store_bind = "127.0.0.1";
  }

  if (auto iface = lookup(getenv, "GLOO_SOCKET_IFNAME")) config.gloo_iface = std::string(*iface);
  ZINF_ASSIGN_OR_RETURN(config.timeout, parse_comm_timeout(getenv));

  if (auto name = lookup(getenv, "ZINF_COMM")) {
    config.backend_explicit = true;
    if (*name == "local") {
      config.backend = Backend::kLocal;
    } else if (*name == "mpi") {
      config.backend = Backend::kMpi;
    } else if (*name == "nccl") {
      config.backend = Backend::kNccl;
    } else if (*name == "gloo") {
      config.backend = Backend::kGloo;
    } else {
      return make_error(ErrorCode::kInvalidArgument,
                        "ZINF_COMM='{}' is not a backend: use local, mpi, nccl or gloo",
                        std::string(*name));
    }
    if (config.backend == Backend::kMpi && !built.mpi) {
      return make_error(ErrorCode::kInvalidArgument,
                        "ZINF_COMM=mpi, but this build has no MPI backend (configure with "
                        "-DZINF_MPI=ON)");
    }
    if (config.backend == Backend::kNccl && !built.nccl) {
      return make_error(ErrorCode::kInvalidArgument,
                        "ZINF_COMM=nccl, but this build has no NCCL backend (configure with "
                        "-DZINF_CUDA=ON)");
    }
    if (config.backend == Backend::kGloo && !built.gloo) {
      return make_error(ErrorCode::kInvalidArgument,
                        "ZINF_COMM=gloo, but this build has no Gloo backend (configure with "
                        "-DZINF_GLOO=ON)");
    }
    return config;
  }

  // What the launcher implies, backends in order: NCCL when it is built and a GPU
  // is visible, then MPI (processes started by mpirun or srun), then Gloo (processes started by
  // a torchrun-style launcher, or by hand, on CPUs), then local threads.
  const bool nccl_first = built.nccl && built.gpus;
  switch (config.source) {
    case EnvSource::kNone:
      config.backend = Backend::kLocal;
      break;
    case EnvSource::kOpenMpi:
    case EnvSource::kSlurm:
      if (nccl_first) {
        config.backend = Backend::kNccl;
      } else if (built.mpi) {
        config.backend = Backend::kMpi;
      } else if (config.world_size > 1) {
        return make_error(ErrorCode::kInvalidArgument,
                          "{} ranks launched through {}, but this build has no MPI backend; set "
                          "ZINF_COMM or rebuild with -DZINF_MPI=ON",
                          config.world_size, env_source_name(config.source));
      }
      break;
    case EnvSource::kTorchrun:
      if (nccl_first) {
        config.backend = Backend::kNccl;
      } else if (config.world_size == 1) {
        config.backend = Backend::kLocal;
      } else if (built.gloo) {
        config.backend = Backend::kGloo;
      } else {
        return make_error(ErrorCode::kInvalidArgument,
                          "WORLD_SIZE={} from a torchrun-style launcher needs the nccl backend "
                          "and a GPU ({}) or the gloo backend (this build has none: configure "
                          "with -DZINF_GLOO=ON); launch with mpirun instead or set ZINF_COMM",
                          config.world_size,
                          built.nccl ? "no GPU is visible" : "this build has no NCCL backend");
      }
      break;
  }
  return config;
}

}  // namespace zinf::comm
