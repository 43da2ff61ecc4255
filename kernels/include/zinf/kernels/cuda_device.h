// Host-side entry points of zinf_kernels_cuda (plain C++: no CUDA headers here).
#pragma once

#include <cstddef>
#include <string>

namespace zinf::kernels::cuda {

// Number of usable CUDA devices; 0 when there is no GPU or no driver (never an error).
int device_count();

// Fills n floats on device 0 with `value` with a kernel, copies them back into `host` and
// returns an empty string, or returns what failed. A smoke test that CUDA code runs.
std::string fill_roundtrip(float* host, size_t n, float value);

}  // namespace zinf::kernels::cuda
