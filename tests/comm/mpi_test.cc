// The MPI backend under mpirun (ctest label mpi: -np 2 and -np 4): the contract of every process
// backend (process_contract.h: the collective suite, the local backend's results bit for bit, the
// faults) and how from_env() reads OpenMPI's variables.
// Every rank runs every test; only rank 0 prints the gtest report (the others print failures).
#include "zinf/comm/mpi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "collective_checks.h"
#include "process_contract.h"
#include "zinf/comm/factory.h"

namespace zinf::comm {
namespace {

using test::ProcessContract;

Communicator* g_comm = nullptr;  // the suite's communicator, over all of MPI_COMM_WORLD

std::unique_ptr<Communicator> make(std::chrono::milliseconds timeout) {
  auto comm = make_mpi_communicator({.timeout = timeout});
  ZINF_CHECK(comm.is_ok(), "{}", comm.status().to_string());
  return std::move(comm).value();
}

TEST(Mpi, FromEnvReadsOpenMpisVariables) {
  auto config = comm_config_from_env();
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  EXPECT_EQ(config->source, EnvSource::kOpenMpi);
  EXPECT_EQ(config->rank, g_comm->rank());
  EXPECT_EQ(config->world_size, g_comm->world_size());
  // NCCL comes first where a GPU is visible; on CPU machines mpirun means MPI.
  EXPECT_EQ(config->backend, backends_built().gpus ? Backend::kNccl : Backend::kMpi);
  config->backend = Backend::kMpi;
  auto comm = create_communicator(*config);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  EXPECT_EQ(comm.value()->backend(), Backend::kMpi);
  EXPECT_TRUE(comm.value()->barrier().wait().is_ok());
}

INSTANTIATE_TEST_SUITE_P(Mpi, ProcessContract,
                         ::testing::Values(test::ProcessBackend{
                             .name = "mpi",
                             .title = "MPI",
                             .suite_comm = [] { return g_comm; },
                             .make = make,
                             .abort_elements = 1024,
                             .late_rank = test::LateRank::kCompletes}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace zinf::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto comm = zinf::comm::make(std::chrono::seconds(60));
  zinf::comm::g_comm = comm.get();
  zinf::comm::test::print_only_failures_unless_rank0(comm->rank());
  const bool passed = zinf::comm::test::every_rank_passed(*comm, RUN_ALL_TESTS());
  comm.reset();
  return passed ? 0 : 1;
}
