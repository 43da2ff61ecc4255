// What the CPU we run on can do, read once with cpuid (never from compile flags: the shipped
// binary must run on any x86-64 CPU and pick its SIMD path at run time).
#pragma once

#include <string>

namespace zinf::kernels {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512bf16 = false;
};

const CpuFeatures& cpu_features();
std::string describe(const CpuFeatures& f);  // "avx2 fma f16c"

}  // namespace zinf::kernels
