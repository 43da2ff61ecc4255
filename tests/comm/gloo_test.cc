// The Gloo backend across processes started the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; no MPI anywhere). Run without those variables, this binary is its own launcher:
// `comm_gloo_test --np N` picks a free port and starts N copies of itself as the ranks, then
// fails unless every rank passes. Each rank runs the contract of every process backend
// (process_contract.h: the collective suite, the local backend's results bit for bit, the faults),
// and the faults and the addressing of Gloo's own.
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
#include "process_contract.h"
#include "zinf/comm/factory.h"

namespace zinf::comm {
namespace {

using namespace std::chrono_literals;
using test::ProcessContract;
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

INSTANTIATE_TEST_SUITE_P(Gloo, ProcessContract,
                         ::testing::Values(test::ProcessBackend{
                             .name = "gloo",
                             .title = "Gloo",
                             .suite_comm = [] { return g_comm; },
                             .make = make,
                             .abort_elements = 1 << 16,
                             .late_rank = test::LateRank::kFailsPromptly}),
                         [](const auto& info) { return std::string(info.param.name); });

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
  const bool passed = zinf::comm::test::every_rank_passed(*comm, RUN_ALL_TESTS());
  comm.reset();
  return passed ? 0 : 1;
}
