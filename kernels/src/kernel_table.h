// The per-instruction-set kernel table behind cpu_adam.h (private to zinf_kernels).
//
// Each SIMD path lives in its own translation unit compiled with its own -m flags and exports
// only a function returning its table. Contract of every table function: it processes a prefix
// [0, done) of whole SIMD groups and returns `done`; the caller finishes [done, n) with the scalar
// table, whose functions always process everything. Because every path evaluates the same
// templates (kernel_loops.h) with the same IEEE operations, where the split falls changes no bit.
//
// ODR rule for the SIMD translation units: they must not call any non-template inline function of
// a shared header (dtype.h's conversions, adam_element, std:: helpers), since the linker could keep
// their AVX-compiled copy for everybody. They use intrinsics and templates instantiated with
// their own internal types only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/core/dtype.h"
#include "zinf/kernels/adam_math.h"
#include "zinf/kernels/cpu_features.h"

namespace zinf::kernels::detail {

enum class CopyKind : uint8_t { kNone, kF32, kBF16, kF16 };

// The arrays of adam_step (or the roofline pass), already offset to the first element processed.
struct AdamSpan {
  float* param;
  float* m;
  float* v;
  const void* grad;
  void* copy;  // nullptr when copy == CopyKind::kNone
  size_t n;
};

inline constexpr size_t kSumSquaresLanes = 16;

struct KernelTable {
  Isa isa;
  size_t (*adam)(const AdamCoeffs& c, const AdamSpan& s, DType grad, CopyKind copy,
                 bool* nonfinite);
  // The roofline pass: param/m/v = x + zero * grad; copy = top 16 bits of param (or param).
  size_t (*traffic)(const AdamSpan& s, DType grad, CopyKind copy, float zero);
  // Adds (double(x[i]) * scale)^2 into lanes[i % 16] with a double FMA; whole groups of 16 only
  // (the scalar table also does the remainder).
  size_t (*sum_squares)(const void* x, DType dtype, size_t n, double scale, double* lanes);
  size_t (*has_nonfinite)(const void* x, DType dtype, size_t n, bool* found);
  size_t (*cast)(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n);
  size_t (*scale)(void* x, DType dtype, size_t n, float scale);
};

const KernelTable& scalar_kernels();
// nullptr where this build has no such path (non-x86 targets).
const KernelTable* avx2_kernels();
const KernelTable* avx512_kernels();

}  // namespace zinf::kernels::detail
