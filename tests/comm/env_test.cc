// Launcher environments: torchrun, OpenMPI and Slurm variables, the implied backend, and errors
// that name the variable.
#include "zinf/comm/env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "collective_checks.h"
#include "zinf/comm/factory.h"

namespace zinf::comm {
namespace {

using ::testing::HasSubstr;

// Parses `env` as if it were the process environment; by default every backend is built and a
// GPU is visible.
Result<CommConfig> parse(std::map<std::string, std::string> env,
                         BackendsBuilt built = {
                             .mpi = true, .nccl = true, .gloo = true, .gpus = true}) {
  return parse_comm_env(
      [&env](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      built);
}

TEST(CommEnv, NothingSetIsOneLocalRank) {
  auto c = parse({});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->backend, Backend::kLocal);
  EXPECT_EQ(c->rank, 0);
  EXPECT_EQ(c->world_size, 1);
  EXPECT_EQ(c->source, EnvSource::kNone);
  EXPECT_EQ(c->store_bind, "127.0.0.1");
  EXPECT_EQ(c->timeout, kDefaultTimeout);
}

TEST(CommEnv, Torchrun) {
  auto c = parse({{"RANK", "3"},
                  {"WORLD_SIZE", "8"},
                  {"LOCAL_RANK", "1"},
                  {"MASTER_ADDR", "10.0.0.5"},
                  {"MASTER_PORT", "29511"}});
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->backend, Backend::kNccl);
  EXPECT_EQ(c->rank, 3);
  EXPECT_EQ(c->world_size, 8);
  EXPECT_EQ(c->local_rank, 1);
  EXPECT_EQ(c->master_addr, "10.0.0.5");
  EXPECT_EQ(c->master_port, 29511);
  EXPECT_EQ(c->store_bind, "10.0.0.5");  // told where to listen: MASTER_ADDR
  EXPECT_EQ(c->source, EnvSource::kTorchrun);
  EXPECT_FALSE(c->backend_explicit);
}

TEST(CommEnv, TorchrunWithoutAGpuIsGlooOrAnExplicitChoice) {
  // No GPU (or no NCCL): Gloo, whatever MPI there is, since no MPI launcher started the ranks.
  auto gloo = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"GLOO_SOCKET_IFNAME", "eth1"}},
                    {.mpi = true, .nccl = true, .gloo = true, .gpus = false});
  ASSERT_TRUE(gloo.is_ok()) << gloo.status().to_string();
  EXPECT_EQ(gloo->backend, Backend::kGloo);
  EXPECT_EQ(gloo->gloo_iface, "eth1");
  EXPECT_EQ(parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {.mpi = false, .nccl = false, .gloo = true})
                ->backend,
            Backend::kGloo);
  // Without Gloo either, the error says what is missing.
  auto c = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {.mpi = true, .nccl = false});
  EXPECT_EQ(c.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("this build has no NCCL backend"));
  EXPECT_THAT(c.status().message(), HasSubstr("-DZINF_GLOO=ON"));
  auto no_gpu = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {.mpi = true, .nccl = true});
  EXPECT_THAT(no_gpu.status().message(), HasSubstr("no GPU is visible"));
  auto explicit_gloo = parse({{"ZINF_COMM", "gloo"}}, {.mpi = true, .nccl = true});
  EXPECT_THAT(explicit_gloo.status().message(), HasSubstr("this build has no Gloo backend"));
  auto one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}, {.mpi = false, .nccl = false});
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->backend, Backend::kLocal);
  one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}, {.mpi = false, .nccl = true, .gpus = false});
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->backend, Backend::kLocal);
  // Under mpirun or srun MPI still comes before Gloo.
  auto mpi = parse({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                   {.mpi = true, .nccl = false, .gloo = true});
  EXPECT_EQ(mpi->backend, Backend::kMpi);
}

// zinf's store goes on MASTER_PORT, except under torchrun, whose agent already serves its own
// store there (TORCHELASTIC_USE_AGENT_STORE=True): then on the next port; ZINF_STORE_PORT wins.
TEST(CommEnv, TheStorePortStaysClearOfTorchrunsOwnStore) {
  auto plain = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29511"}});
  ASSERT_TRUE(plain.is_ok());
  EXPECT_EQ(plain->store_port, 29511);
  auto agent = parse({{"RANK", "0"},
                      {"WORLD_SIZE", "2"},
                      {"MASTER_PORT", "29511"},
                      {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  ASSERT_TRUE(agent.is_ok());
  EXPECT_EQ(agent->master_port, 29511);
  EXPECT_EQ(agent->store_port, 29512);
  auto no_agent = parse({{"RANK", "0"},
                         {"WORLD_SIZE", "2"},
                         {"MASTER_PORT", "29511"},
                         {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_EQ(no_agent->store_port, 29511);
  auto chosen = parse({{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                       {"ZINF_STORE_PORT", "40000"}});
  EXPECT_EQ(chosen->store_port, 40000);
  auto last = parse({{"MASTER_PORT", "65535"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(last.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(last.status().message(), HasSubstr("set ZINF_STORE_PORT"));
  auto bad = parse({{"ZINF_STORE_PORT", "0"}});
  EXPECT_THAT(bad.status().message(), HasSubstr("ZINF_STORE_PORT=0 is out of range"));
}

TEST(CommEnv, OpenMpi) {
  auto c = parse({{"OMPI_COMM_WORLD_RANK", "1"},
                  {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
                 {.mpi = true, .nccl = true, .gpus = false});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->backend, Backend::kMpi);
  EXPECT_EQ(c->rank, 1);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->source, EnvSource::kOpenMpi);
  EXPECT_EQ(c->store_bind, "127.0.0.1");
}

TEST(CommEnv, NcclFirstWhereAGpuIsVisible) {
  auto mpirun = parse({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  ASSERT_TRUE(mpirun.is_ok());
  EXPECT_EQ(mpirun->backend, Backend::kNccl);
  auto one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(one->backend, Backend::kNccl);
  auto cpu = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}, {.mpi = true, .nccl = true});
  EXPECT_EQ(cpu->backend, Backend::kLocal);
  auto none = parse({});
  EXPECT_EQ(none->backend, Backend::kLocal);
}

TEST(CommEnv, Slurm) {
  auto c =
      parse({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "2"}}, {.mpi = true});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->backend, Backend::kMpi);
  EXPECT_EQ(c->rank, 5);
  EXPECT_EQ(c->local_rank, 2);
  EXPECT_EQ(c->source, EnvSource::kSlurm);
}

TEST(CommEnv, TorchrunVariablesWinOverTheOthers) {
  auto c = parse({{"RANK", "0"},
                  {"WORLD_SIZE", "2"},
                  {"OMPI_COMM_WORLD_RANK", "1"},
                  {"OMPI_COMM_WORLD_SIZE", "2"},
                  {"SLURM_PROCID", "1"},
                  {"SLURM_NTASKS", "2"}});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->source, EnvSource::kTorchrun);
  EXPECT_EQ(c->rank, 0);
}

TEST(CommEnv, ExplicitBackendAndTimeout) {
  auto c = parse({{"ZINF_COMM", "mpi"},
                  {"ZINF_COMM_TIMEOUT", "2.5"},
                  {"RANK", "0"},
                  {"WORLD_SIZE", "2"},
                  {"ZINF_STORE_BIND", "0.0.0.0"}});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->backend, Backend::kMpi);
  EXPECT_TRUE(c->backend_explicit);
  EXPECT_EQ(c->timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(c->store_bind, "0.0.0.0");
  auto missing = parse({{"ZINF_COMM", "nccl"}}, {.mpi = true, .nccl = false});
  EXPECT_THAT(missing.status().message(), HasSubstr("no NCCL backend"));
}

TEST(CommEnv, ErrorsNameTheVariable) {
  struct Case {
    std::map<std::string, std::string> env;
    const char* expect;
  };
  const Case cases[] = {
      {{{"WORLD_SIZE", "0"}}, "WORLD_SIZE=0: the world size must be at least 1"},
      {{{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, "RANK='abc' is not an integer"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is not below WORLD_SIZE=2"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1 is out of range"},
      {{{"RANK", "1"}}, "RANK is set but WORLD_SIZE is not"},
      {{{"WORLD_SIZE", "4"}}, "WORLD_SIZE=4 is set but RANK is not"},
      {{{"OMPI_COMM_WORLD_SIZE", "0"}}, "OMPI_COMM_WORLD_SIZE=0"},
      {{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "x1"}}, "SLURM_NTASKS='x1' is not an integer"},
      {{{"MASTER_PORT", "70000"}}, "MASTER_PORT=70000 is out of range [1, 65535]"},
      {{{"LOCAL_RANK", "q"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}}, "LOCAL_RANK='q'"},
      {{{"ZINF_COMM", "ucc"}}, "ZINF_COMM='ucc' is not a backend: use local, mpi, nccl or gloo"},
      {{{"ZINF_COMM_TIMEOUT", "0"}}, "ZINF_COMM_TIMEOUT='0' is not a positive number"},
      {{{"ZINF_COMM_TIMEOUT", "5s"}}, "ZINF_COMM_TIMEOUT='5s'"},
  };
  for (const Case& c : cases) {
    auto r = parse(c.env);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(r.status().message(), HasSubstr(c.expect));
  }
}

TEST(CommEnv, TheTimeoutAloneIsReadTheSameWayForCallersThatBuildTheirOwnGroups) {
  auto get = [](std::map<std::string, std::string> env) {
    return parse_comm_timeout([&env](const char* name) -> const char* {
      auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  };
  EXPECT_EQ(get({}).value(), kDefaultTimeout);
  EXPECT_EQ(get({{"ZINF_COMM_TIMEOUT", "0.25"}}).value(), std::chrono::milliseconds(250));
  auto bad = get({{"ZINF_COMM_TIMEOUT", "-3"}});
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("ZINF_COMM_TIMEOUT='-3' is not a positive"));
}

TEST(CommFactory, LocalConfigs) {
  EXPECT_TRUE(backend_available(Backend::kLocal));
  auto one = create_communicator({});
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one.value()->world_size(), 1);
  EXPECT_EQ(one.value()->backend(), Backend::kLocal);
  float x = 3.0f;
  EXPECT_TRUE(one.value()->all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kAvg).wait().is_ok());
  EXPECT_EQ(x, 3.0f);
  auto many = create_communicator({.backend = Backend::kLocal, .world_size = 4});
  EXPECT_EQ(many.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(many.status().message(), HasSubstr("make_local_group"));
}

}  // namespace
}  // namespace zinf::comm
