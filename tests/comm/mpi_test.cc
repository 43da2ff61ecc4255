// The MPI backend under mpirun (ctest label mpi: -np 2 and -np 4). The same collective suite as
// the local backend, the local backend's results reproduced bit for bit, and the faults.
// Every rank runs every test; only rank 0 prints the gtest report (the others print failures).
#include "zinf/comm/mpi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "collective_checks.h"
#include "zinf/comm/factory.h"

namespace zinf::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

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

TEST(Mpi, EveryOperationMatchesTheRankOrderReferenceBitForBit) {
  std::vector<std::string> failures = test::run_sweep(*g_comm);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST(Mpi, ResultsEqualTheLocalBackendAtTheSameWorldSize) {
  std::vector<std::string> failures = test::compare_with_local_group(*g_comm);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST(Mpi, MismatchedCountsFailOnEveryRankAndTheCommunicatorGoesOn) {
  const int me = g_comm->rank(), world = g_comm->world_size();
  std::vector<float> send(16), recv(16 * world);
  size_t count = me == world - 1 ? 12 : 10;
  Status s = g_comm->all_gather(send.data(), recv.data(), count, DType::kF32).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_THAT(s.message(), HasSubstr("ranks disagree on the element counts"));
  EXPECT_THAT(s.message(),
              HasSubstr(fmt::format("12 of {} elements on rank {}", 12 * world, world - 1)));
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Mpi, MismatchedOperationsAndInvalidArgumentsFailEveryRank) {
  const int me = g_comm->rank();
  std::vector<float> buf(8);
  Status ops =
      me == 0 ? g_comm->barrier().wait() : g_comm->broadcast(buf.data(), 8, DType::kF32, 0).wait();
  EXPECT_THAT(ops.message(), HasSubstr("ranks issued different collectives"));
  Status invalid =
      g_comm->all_reduce(me == 1 ? nullptr : buf.data(), buf.data(), 8, DType::kF32, ReduceOp::kSum)
          .wait();
  EXPECT_EQ(invalid.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(invalid.message(), HasSubstr("rank 1 passed invalid arguments"));
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Mpi, APeerThatNeverArrivesIsNamedWithinTheTimeout) {
  // A communicator of its own, with a short timeout: the last rank comes late to a barrier.
  const int me = g_comm->rank(), world = g_comm->world_size();
  {
    auto comm = make(400ms);
    if (me == world - 1) {
      std::this_thread::sleep_for(1500ms);
      // Everyone else did arrive at this barrier, only earlier: the late rank completes it.
      EXPECT_TRUE(comm->barrier().wait().is_ok());
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s = comm->barrier().wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 1400ms);
      EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
      EXPECT_THAT(s.message(),
                  HasSubstr(fmt::format("rank {} did not arrive within 0.4 s", world - 1)));
      // Broken for good.
      EXPECT_EQ(comm->barrier().wait().code(), ErrorCode::kTimeout);
    }
  }
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Mpi, AFailedRankAbortsAndEveryPeerStopsWithItsErrorLongBeforeTheTimeout) {
  // A communicator of its own with a 60 s timeout; rank 1 fails before the all_reduce that the
  // others are waiting in, and aborts.
  const int me = g_comm->rank();
  {
    auto comm = make(60s);
    std::vector<float> buf(1024, 1.0f);
    if (me == 1) {
      std::this_thread::sleep_for(200ms);  // the peers are in the all_reduce by now
      comm->abort(make_error(ErrorCode::kIo, "write of 4096 bytes of swap-0.bin: EIO"));
      Status own = comm->barrier().wait();
      EXPECT_EQ(own.code(), ErrorCode::kCancelled) << own.to_string();
      EXPECT_THAT(own.message(), HasSubstr("rank 1 aborted its mpi communicator"));
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s =
          comm->all_reduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum).wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
      EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
      EXPECT_THAT(s.message(), HasSubstr("rank 1 failed: write of 4096 bytes of swap-0.bin: EIO; "
                                         "the MPI communicator is aborted"));
      // Broken for good, and a rank that reacts by aborting too does not hide the cause.
      comm->abort(make_error(ErrorCode::kUnavailable, "an echo"));
      EXPECT_THAT(comm->barrier().wait().message(), HasSubstr("aborted"));
    }
  }
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

}  // namespace
}  // namespace zinf::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto comm = zinf::comm::make(std::chrono::seconds(60));
  zinf::comm::g_comm = comm.get();
  zinf::comm::test::print_only_failures_unless_rank0(comm->rank());
  int failed = RUN_ALL_TESTS();
  // Every rank's verdict: the job fails if any rank failed.
  float any = failed ? 1.0f : 0.0f;
  bool ok =
      comm->all_reduce(&any, &any, 1, zinf::DType::kF32, zinf::comm::ReduceOp::kSum).wait().is_ok();
  comm.reset();
  return ok && any == 0.0f ? 0 : 1;
}
