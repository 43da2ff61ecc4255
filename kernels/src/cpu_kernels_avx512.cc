// The AVX-512 path: 16 fp32 lanes. This file alone is compiled with -mavx512f -mavx512bw
// -mavx512dq -mavx512vl (kernels/CMakeLists.txt) and is only entered where
// isa_supported(Isa::kAvx512). See kernel_table.h for the rules such a file follows.
//
// AVX512-BF16's VCVTNEPS2BF16 is deliberately not used: it flushes subnormals, so it would not
// match f32_to_bf16 bit for bit. The integer rounding below does.
#include <immintrin.h>

#include "kernel_loops.h"

namespace zinf::kernels::detail {
namespace {

struct Avx512 {
  static constexpr size_t kW = 16;
  using F = __m512;

  static F splat(float x) { return _mm512_set1_ps(x); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }

  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm512_storeu_ps(p, x); }

  static __m256i load_u16x16(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void store_u16x16(uint16_t* p, __m256i x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }

  static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_u16x16(p)), 16));
  }
  // f32_to_bf16: NaN -> (bits >> 16) | 0x40; else (bits + 0x7fff + lsb) >> 16 (nearest even).
  static void store_bf16(uint16_t* p, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    store_u16x16(p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet)));
  }
  // VCVTPH2PS quiets signalling NaNs; f16_to_f32 keeps them: clear the quiet bit again there.
  static F load_f16(const uint16_t* p) {
    const __m256i h = load_u16x16(p);
    const __m512i wide = _mm512_castps_si512(_mm512_cvtph_ps(h));
    const __m512i abs = _mm512_and_si512(_mm512_cvtepu16_epi32(h), _mm512_set1_epi32(0x7fff));
    const __mmask16 snan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7c00)) &
                           _mm512_cmplt_epi32_mask(abs, _mm512_set1_epi32(0x7e00));
    return _mm512_castsi512_ps(
        _mm512_mask_and_epi32(wide, snan, wide, _mm512_set1_epi32(~0x00400000)));
  }
  static void store_f16(uint16_t* p, F x) {
    store_u16x16(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_top16(uint16_t* p, F x) {
    store_u16x16(p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }

  using NonFinite = __mmask16;
  static NonFinite nonfinite_none() { return 0; }
  static NonFinite nonfinite_add(NonFinite acc, F x) {
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exp);
    return static_cast<NonFinite>(acc | _mm512_cmpeq_epi32_mask(e, exp));
  }
  static bool nonfinite_any(NonFinite acc) { return acc != 0; }

  struct SquareSums {
    __m512d lane[2];  // lane[k] holds lanes 8k .. 8k+7
  };
  static SquareSums squares_load(const double* lanes) {
    return SquareSums{{_mm512_loadu_pd(lanes), _mm512_loadu_pd(lanes + 8)}};
  }
  static void squares_store(double* lanes, const SquareSums& s) {
    _mm512_storeu_pd(lanes, s.lane[0]);
    _mm512_storeu_pd(lanes + 8, s.lane[1]);
  }
  static void squares_add16(SquareSums& s, const F* x, double scale) {
    const __m512d sc = _mm512_set1_pd(scale);
    const __m256 half[2] = {_mm512_castps512_ps256(x[0]), _mm512_extractf32x8_ps(x[0], 1)};
    for (int k = 0; k < 2; ++k) {
      const __m512d d = _mm512_mul_pd(_mm512_cvtps_pd(half[k]), sc);  // exact: 24 x 24 bits
      s.lane[k] = _mm512_fmadd_pd(d, d, s.lane[k]);
    }
  }
};

}  // namespace

const KernelTable* avx512_kernels() {
  static const KernelTable table = make_table<Avx512>(Isa::kAvx512);
  return &table;
}

}  // namespace zinf::kernels::detail
