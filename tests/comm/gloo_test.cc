// The Gloo backend across processes started the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; no MPI anywhere). Run without those variables, this binary is its own launcher:
// `comm_gloo_test --np N` picks a free port and starts N copies of itself as the ranks, then
// fails unless every rank passes. Each rank runs the collective suite every backend runs (bit
// for bit against the rank-order reference), the local backend's results, and the faults.
#include "zinf/comm/gloo.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "collective_checks.h"
#include "zinf/comm/factory.h"

namespace zinf::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::AnyOf;
using ::testing::HasSubstr;

Communicator* g_comm = nullptr;  // the suite's communicator, over every rank
CommConfig g_config;             // what the environment said

std::unique_ptr<Communicator> make(std::chrono::milliseconds timeout) {
  CommConfig config = g_config;
  config.backend = Backend::kGloo;
  config.timeout = timeout;
  auto comm = create_communicator(config);
  ZINF_CHECK(comm.is_ok(), "{}", comm.status().to_string());
  return std::move(comm).value();
}

TEST(Gloo, FromEnvReadsTorchrunsVariablesAndPicksGlooWithoutAGpu) {
  EXPECT_EQ(g_config.source, EnvSource::kTorchrun);
  EXPECT_EQ(g_config.rank, g_comm->rank());
  EXPECT_EQ(g_config.world_size, g_comm->world_size());
  EXPECT_EQ(g_config.backend, backends_built().gpus ? Backend::kNccl : Backend::kGloo);
  EXPECT_EQ(g_comm->backend(), Backend::kGloo);
}

TEST(Gloo, EveryOperationMatchesTheRankOrderReferenceBitForBit) {
  std::vector<std::string> failures = test::run_sweep(*g_comm);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST(Gloo, ResultsEqualTheLocalBackendAtTheSameWorldSize) {
  std::vector<std::string> failures = test::compare_with_local_group(*g_comm);
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
}

TEST(Gloo, MismatchedCountsFailOnEveryRankAndTheCommunicatorGoesOn) {
  const int me = g_comm->rank(), world = g_comm->world_size();
  std::vector<float> send(16), recv(16 * world);
  size_t count = me == world - 1 ? 12 : 10;
  Status s = g_comm->all_gather(send.data(), recv.data(), count, DType::kF32).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_THAT(s.message(), HasSubstr("ranks disagree on the element counts"));
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Gloo, MismatchedOperationsAndInvalidArgumentsFailEveryRank) {
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

TEST(Gloo, APeerThatNeverArrivesIsNamedWithinTheTimeout) {
  // A communicator of its own, with a short timeout: the last rank comes late to a barrier.
  const int me = g_comm->rank(), world = g_comm->world_size();
  {
    auto comm = make(400ms);
    if (me == world - 1) {
      std::this_thread::sleep_for(1500ms);
      // The others gave up and closed their connections: the late rank fails too, promptly.
      auto start = std::chrono::steady_clock::now();
      Status s = comm->barrier().wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms);
      EXPECT_THAT(s.code(), AnyOf(ErrorCode::kUnavailable, ErrorCode::kTimeout)) << s.to_string();
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

TEST(Gloo, AFailedRankAbortsAndEveryPeerStopsWithItsErrorLongBeforeTheTimeout) {
  // A communicator of its own with a 60 s timeout; rank 1 fails before the all_reduce that the
  // others are waiting in, and aborts.
  const int me = g_comm->rank();
  {
    auto comm = make(60s);
    std::vector<float> buf(1 << 16, 1.0f);
    if (me == 1) {
      std::this_thread::sleep_for(200ms);  // the peers are in the all_reduce by now
      comm->abort(make_error(ErrorCode::kIo, "write of 4096 bytes of swap-0.bin: EIO"));
      Status own = comm->barrier().wait();
      EXPECT_EQ(own.code(), ErrorCode::kCancelled) << own.to_string();
      EXPECT_THAT(own.message(), HasSubstr("rank 1 aborted its gloo communicator"));
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s =
          comm->all_reduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum).wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
      EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
      EXPECT_THAT(s.message(), HasSubstr("rank 1 failed: write of 4096 bytes of swap-0.bin: EIO; "
                                         "the Gloo communicator is aborted"));
      // Broken for good; aborting in turn sends nothing more (the peers know already).
      comm->abort(make_error(ErrorCode::kUnavailable, "an echo"));
      EXPECT_THAT(comm->barrier().wait().message(), HasSubstr("aborted"));
    }
  }
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Gloo, RanksAbortingAtOnceEachReturnPromptlyAndThePeersHearOfIt) {
  // Ranks 0 and 1 fail at the same moment: each one's reason reaches the other (every peer has a
  // slot of its own on the abort channel), so neither abort() waits out its send deadline.
  const int me = g_comm->rank();
  {
    auto comm = make(60s);
    std::vector<float> buf(4096, 1.0f);
    if (me <= 1) {
      std::this_thread::sleep_for(200ms);
      auto start = std::chrono::steady_clock::now();
      comm->abort(make_error(ErrorCode::kIo, "disk of rank {} is gone", me));
      EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms);
      EXPECT_EQ(comm->barrier().wait().code(), ErrorCode::kCancelled);
    } else {
      auto start = std::chrono::steady_clock::now();
      Status s =
          comm->all_reduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum).wait();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
      EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
      EXPECT_THAT(s.message(), HasSubstr("is gone; the Gloo communicator is aborted"));
    }
  }
  EXPECT_TRUE(g_comm->barrier().wait().is_ok());
}

TEST(Gloo, TheLocalAddressTowardTheMasterIsNumeric) {
  auto loopback = local_address_toward("127.0.0.1", 29500);
  ASSERT_TRUE(loopback.is_ok()) << loopback.status().to_string();
  EXPECT_EQ(*loopback, "127.0.0.1");
  auto bad = local_address_toward("no-such-host.invalid", 29500);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr("cannot resolve MASTER_ADDR 'no-such-host.invalid'"));
}

// A port nobody listens on now (the kernel's pick for a socket bound to port 0).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ZINF_CHECK(fd >= 0, "socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  ZINF_CHECK(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                 getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0,
             "bind: {}", std::strerror(errno));
  close(fd);
  return ntohs(addr.sin_port);
}

// Starts `np` ranks of this binary and waits for them (at most `limit`); 0 when all pass.
int launch(int np, char** argv, std::chrono::seconds limit) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < np; ++r) {
    pid_t pid = fork();
    ZINF_CHECK(pid >= 0, "fork: {}", std::strerror(errno));
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(np).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      unsetenv("ZINF_COMM");
      execv("/proc/self/exe", argv);
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int failed = 0, running = np;
  while (running > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      --running;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ++failed;
        std::fprintf(stderr, "launcher: rank pid %d ended with status %d\n", pid, status);
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "launcher: ranks still running after %lld s: killed\n",
                   static_cast<long long>(limit.count()));
      for (pid_t p : pids) kill(p, SIGKILL);
      while (waitpid(-1, nullptr, 0) > 0) {
      }
      return 1;
    }
    std::this_thread::sleep_for(50ms);
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace zinf::comm

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) {
    int np = 2;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::strcmp(argv[i], "--np") == 0) np = std::atoi(argv[i + 1]);
    }
    return zinf::comm::launch(np, argv, std::chrono::seconds(240));
  }
  ::testing::InitGoogleTest(&argc, argv);
  auto config = zinf::comm::comm_config_from_env();
  ZINF_CHECK(config.is_ok(), "{}", config.status().to_string());
  zinf::comm::g_config = *config;
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
