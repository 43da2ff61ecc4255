// The contract every backend whose ranks are processes (MPI, Gloo) keeps, as one suite that each
// backend's test binary instantiates once with what tells the backends apart:
//   INSTANTIATE_TEST_SUITE_P(Mpi, ProcessContract, ::testing::Values(test::ProcessBackend{...}));
// The collective suite bit for bit against the rank-order reference and against the local
// backend, and the faults (communicator.h, "Faults"): mismatched shapes and invalid arguments fail
// every rank and leave the communicator usable; a peer that never arrives is named within the
// timeout; a rank that aborts stops every peer with its reason long before the timeout.
// Include it in one file of the binary: it defines the tests.
#pragma once

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "collective_checks.h"
#include "zinf/comm/communicator.h"

namespace zinf::comm::test {

// What the rank that comes late to a barrier sees once its peers have timed out there.
enum class LateRank : uint8_t {
  kCompletes,      // the peers did arrive, only earlier: its barrier completes (MPI)
  kFailsPromptly,  // the peers closed their connections: it fails at once (Gloo)
};

struct ProcessBackend {
  const char* name = "";                    // as in "rank 1 aborted its <name> communicator"
  const char* title = "";                   // as in "the <title> communicator is aborted"
  Communicator* (*suite_comm)() = nullptr;  // the binary's communicator over every rank
  std::unique_ptr<Communicator> (*make)(std::chrono::milliseconds timeout) = nullptr;  // a new one
  size_t abort_elements = 0;  // the all_reduce in which a failing rank's peers wait
  LateRank late_rank = LateRank::kCompletes;
};
inline void PrintTo(const ProcessBackend& b, std::ostream* os) { *os << b.name; }

class ProcessContract : public ::testing::TestWithParam<ProcessBackend> {
 protected:
  Communicator& suite() { return *GetParam().suite_comm(); }
};

TEST_P(ProcessContract, EveryOperationMatchesTheRankOrderReferenceBitForBit) {
  std::vector<std::string> failures = run_sweep(suite());
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST_P(ProcessContract, ResultsEqualTheLocalBackendAtTheSameWorldSize) {
  std::vector<std::string> failures = compare_with_local_group(suite());
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST_P(ProcessContract, MismatchedCountsFailOnEveryRankAndTheCommunicatorGoesOn) {
  Communicator& comm = suite();
  const int me = comm.rank(), world = comm.world_size();
  std::vector<float> send(16), recv(16 * world);
  size_t count = me == world - 1 ? 12 : 10;
  Status s = comm.all_gather(send.data(), recv.data(), count, DType::kF32).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_THAT(s.message(), ::testing::HasSubstr("ranks disagree on the element counts"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr(
                               fmt::format("12 of {} elements on rank {}", 12 * world, world - 1)));
  EXPECT_TRUE(comm.barrier().wait().is_ok());
}

TEST_P(ProcessContract, MismatchedOperationsAndInvalidArgumentsFailEveryRank) {
  Communicator& comm = suite();
  const int me = comm.rank();
  std::vector<float> buf(8);
  Status ops =
      me == 0 ? comm.barrier().wait() : comm.broadcast(buf.data(), 8, DType::kF32, 0).wait();
  EXPECT_THAT(ops.message(), ::testing::HasSubstr("ranks issued different collectives"));
  Status invalid =
      comm.all_reduce(me == 1 ? nullptr : buf.data(), buf.data(), 8, DType::kF32, ReduceOp::kSum)
          .wait();
  EXPECT_EQ(invalid.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(invalid.message(), ::testing::HasSubstr("rank 1 passed invalid arguments"));
  EXPECT_TRUE(comm.barrier().wait().is_ok());
}

TEST_P(ProcessContract, APeerThatNeverArrivesIsNamedWithinTheTimeout) {
  using namespace std::chrono_literals;
  // A communicator of its own, with a short timeout: the last rank comes late to a barrier.
  const int me = suite().rank(), world = suite().world_size();
  {
    auto comm = GetParam().make(400ms);
    if (me == world - 1) {
      std::this_thread::sleep_for(1500ms);
      if (GetParam().late_rank == LateRank::kCompletes) {
        // Everyone else did arrive at this barrier, only earlier: the late rank completes it.
        EXPECT_TRUE(comm->barrier().wait().is_ok());
      } else {
        // The others gave up and closed their connections: the late rank fails too, promptly.
        auto start = std::chrono::steady_clock::now();
        Status s = comm->barrier().wait();
        EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms);
        EXPECT_THAT(s.code(), ::testing::AnyOf(ErrorCode::kUnavailable, ErrorCode::kTimeout))
            << s.to_string();
      }
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s = comm->barrier().wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 1400ms);
      EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
      EXPECT_THAT(s.message(), ::testing::HasSubstr(
                                   fmt::format("rank {} did not arrive within 0.4 s", world - 1)));
      // Broken for good.
      EXPECT_EQ(comm->barrier().wait().code(), ErrorCode::kTimeout);
    }
  }
  EXPECT_TRUE(suite().barrier().wait().is_ok());
}

TEST_P(ProcessContract, AFailedRankAbortsAndEveryPeerStopsWithItsErrorLongBeforeTheTimeout) {
  using namespace std::chrono_literals;
  // A communicator of its own with a 60 s timeout; rank 1 fails before the all_reduce that the
  // others are waiting in, and aborts.
  const ProcessBackend& backend = GetParam();
  const int me = suite().rank();
  {
    auto comm = backend.make(60s);
    std::vector<float> buf(backend.abort_elements, 1.0f);
    if (me == 1) {
      std::this_thread::sleep_for(200ms);  // the peers are in the all_reduce by now
      comm->abort(make_error(ErrorCode::kIo, "write of 4096 bytes of swap-0.bin: EIO"));
      Status own = comm->barrier().wait();
      EXPECT_EQ(own.code(), ErrorCode::kCancelled) << own.to_string();
      EXPECT_THAT(own.message(), ::testing::HasSubstr(fmt::format(
                                     "rank 1 aborted its {} communicator", backend.name)));
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s =
          comm->all_reduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum).wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
      EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
      EXPECT_THAT(s.message(), ::testing::HasSubstr(
                                   fmt::format("rank 1 failed: write of 4096 bytes of "
                                               "swap-0.bin: EIO; the {} communicator is aborted",
                                               backend.title)));
      // Broken for good, and a rank that reacts by aborting too does not hide the cause (nor
      // sends anything more: the peers know already).
      comm->abort(make_error(ErrorCode::kUnavailable, "an echo"));
      EXPECT_THAT(comm->barrier().wait().message(), ::testing::HasSubstr("aborted"));
    }
  }
  EXPECT_TRUE(suite().barrier().wait().is_ok());
}

// The job's verdict, from every rank's RUN_ALL_TESTS() result `failed`: whether every rank passed.
// Every rank calls it on the suite's communicator.
inline bool every_rank_passed(Communicator& comm, int failed) {
  float any = failed ? 1.0f : 0.0f;
  bool ok = comm.all_reduce(&any, &any, 1, DType::kF32, ReduceOp::kSum).wait().is_ok();
  return ok && any == 0.0f;
}

}  // namespace zinf::comm::test
