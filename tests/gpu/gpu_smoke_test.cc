// Runs a CUDA kernel and checks every element it wrote. Exits 77 (skip) without a GPU.
#include <cstdio>
#include <vector>

#include "zinf/kernels/cuda_device.h"

int main() {
  if (zinf::kernels::cuda::device_count() == 0) {
    std::puts("no CUDA device: skipping");
    return 77;
  }
  std::vector<float> host(1000003, 0.0f);
  std::string err = zinf::kernels::cuda::fill_roundtrip(host.data(), host.size(), 3.5f);
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return 1;
  }
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != 3.5f) {
      std::fprintf(stderr, "element %zu is %g, expected 3.5\n", i, host[i]);
      return 1;
    }
  }
  std::puts("ok");
  return 0;
}
