// The NCCL backend on every visible GPU (one rank thread per device, bootstrapped through the TCP
// store on 127.0.0.1): the same collective suite as the CPU backends, with device buffers, so GPU
// results are checked against the same rank-order reference bit for bit. Exits 77 (ctest skip)
// without a GPU.
#include "zinf/comm/nccl.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <thread>

#include "collective_checks.h"
#include "zinf/comm/store.h"

namespace {

using namespace zinf;
using namespace zinf::comm;

class CudaMemory final : public test::TestMemory {
 public:
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    ZINF_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)) == cudaSuccess);
    return p;
  }
  void release(void* ptr) override { cudaFree(ptr); }
  void upload(void* dst, const void* src, size_t bytes) override {
    ZINF_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    ZINF_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  }
};

}  // namespace

int main() {
  const int devices = cuda_device_count();
  if (devices == 0) {
    std::puts("no CUDA device: skipping");
    return 77;
  }
  const int world = std::min(devices, 4);
  auto probe = TcpStoreServer::start({.token = ""});
  ZINF_CHECK(probe.is_ok(), "{}", probe.status().to_string());
  const uint16_t port = probe.value()->port();
  probe.value().reset();

  std::vector<std::vector<std::string>> failures(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ZINF_CHECK(cudaSetDevice(r) == cudaSuccess);
      auto comm = make_nccl_communicator(
          {.rank = r,
           .world_size = world,
           .device = r,
           .timeout = std::chrono::seconds(60),
           .share_unique_id = store_share_from_rank0({.rank = r,
                                                      .world_size = world,
                                                      .master_port = port,
                                                      .key = "nccl_test/id",
                                                      .timeout = std::chrono::seconds(60)})});
      if (!comm.is_ok()) {
        failures[r].push_back(comm.status().to_string());
        return;
      }
      CudaMemory memory;
      test::SweepOptions options;
      options.memory = &memory;
      failures[r] = test::run_sweep(*comm.value(), options);
      // Abort: every rank aborts (a rank whose peers still held a live communicator
      // could wait on them in ncclCommDestroy); its later operations fail at once without touching
      // NCCL, and the destructor calls ncclCommAbort.
      comm.value()->abort(make_error(ErrorCode::kIo, "injected"));
      Status s = comm.value()->barrier().wait();
      if (s.code() != ErrorCode::kCancelled ||
          s.message().find(fmt::format("rank {} aborted its nccl communicator: injected", r)) ==
              std::string::npos) {
        failures[r].push_back("after abort, barrier gave: " + s.to_string());
      }
    });
  }
  for (auto& t : threads) t.join();
  int failed = 0;
  for (int r = 0; r < world; ++r) {
    for (const std::string& f : failures[r]) {
      std::fprintf(stderr, "FAIL %s\n", f.c_str());
      ++failed;
    }
  }
  std::printf("nccl: %d rank(s), %s\n", world, failed ? "FAILED" : "ok");
  return failed ? 1 : 0;
}
