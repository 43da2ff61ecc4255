// What the CPU we run on can do, read once with cpuid (never from compile flags: the shipped
// binary must run on any x86-64 CPU and pick its SIMD path at run time).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace zinf::kernels {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
};

const CpuFeatures& cpu_features();
std::string describe(const CpuFeatures& f);  // "avx2 fma f16c"

// The instruction-set paths of the CPU kernels (cpu_adam.h). Every path computes the same bits;
// they differ only in speed. kAuto picks best_isa().
enum class Isa : uint8_t {
  kAuto,
  kScalar,  // plain C++: any CPU
  kAvx2,    // AVX2 + FMA + F16C (Haswell, Zen 1 and later)
  kAvx512,  // AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later)
};

std::string_view isa_name(Isa isa);  // "auto", "scalar", "avx2", "avx512"
std::optional<Isa> parse_isa(std::string_view name);
// Whether this binary has the path and this CPU (and OS) can run it. kAuto and kScalar: always.
bool isa_supported(Isa isa);
// The fastest supported path: kAvx512, else kAvx2, else kScalar.
Isa best_isa();

}  // namespace zinf::kernels
