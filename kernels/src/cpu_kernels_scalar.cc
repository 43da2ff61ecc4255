// The scalar path: one lane, plain C++ built for the baseline target. It is the fallback on CPUs
// without AVX2 and finishes the tail of every SIMD call, so it must give the SIMD paths' bits:
// it instantiates the same loops with ScalarMath (adam_math.h) and dtype.h's conversions.
#include <cmath>

#include "kernel_loops.h"

namespace zinf::kernels::detail {
namespace {

struct Scalar : ScalarMath {
  static constexpr size_t kW = 1;
  using F = float;

  static F splat(float x) { return x; }

  static F load_f32(const float* p) { return *p; }
  static void store_f32(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static void store_bf16(uint16_t* p, F x) { *p = f32_to_bf16(x); }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_f16(uint16_t* p, F x) { *p = f32_to_f16(x); }
  static void store_top16(uint16_t* p, F x) { *p = static_cast<uint16_t>(f32_bits(x) >> 16); }

  using NonFinite = bool;
  static NonFinite nonfinite_none() { return false; }
  static NonFinite nonfinite_add(NonFinite acc, F x) { return acc || !is_finite_f32(x); }
  static bool nonfinite_any(NonFinite acc) { return acc; }

  struct SquareSums {
    double lane[kSumSquaresLanes];
  };
  static SquareSums squares_load(const double* lanes) {
    SquareSums s;
    for (size_t t = 0; t < kSumSquaresLanes; ++t) s.lane[t] = lanes[t];
    return s;
  }
  static void squares_store(double* lanes, const SquareSums& s) {
    for (size_t t = 0; t < kSumSquaresLanes; ++t) lanes[t] = s.lane[t];
  }
  static void square_add(double& lane, F x, double scale) {
    const double d = static_cast<double>(x) * scale;  // exact: 24 x 24 bits
    lane = std::fma(d, d, lane);
  }
  static void squares_add16(SquareSums& s, const F* x, double scale) {
    for (size_t t = 0; t < kSumSquaresLanes; ++t) square_add(s.lane[t], x[t], scale);
  }
};

}  // namespace

const KernelTable& scalar_kernels() {
  static const KernelTable table = make_table<Scalar>(Isa::kScalar);
  return table;
}

#if !defined(ZINF_KERNELS_X86)
const KernelTable* avx2_kernels() { return nullptr; }
const KernelTable* avx512_kernels() { return nullptr; }
#endif

}  // namespace zinf::kernels::detail
