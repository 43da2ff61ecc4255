// The AVX2 + FMA + F16C path: 8 fp32 lanes. This file alone is compiled with -mavx2 -mfma -mf16c
// (kernels/CMakeLists.txt) and is only entered where isa_supported(Isa::kAvx2). See kernel_table.h
// for the rules such a file follows.
#include <immintrin.h>

#include "kernel_loops.h"

namespace zinf::kernels::detail {
namespace {

struct Avx2 {
  static constexpr size_t kW = 8;
  using F = __m256;

  static F splat(float x) { return _mm256_set1_ps(x); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }

  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }

  static __m128i load_u16x8(const uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  static void store_u16x8(uint16_t* p, __m128i x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
  }
  // The high 16 bits of each of the 8 u32 lanes, stored as 8 x u16.
  static void store_high_halves(uint16_t* p, __m256i x) {
    const __m256i pick =
        _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10,
                         11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0x08);
    store_u16x8(p, _mm256_castsi256_si128(packed));
  }

  static F load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_u16x8(p)), 16));
  }
  // f32_to_bf16, branch-free: NaN lanes get the quiet bit and no rounding bias, so that
  // (bits | quiet) >> 16 = (bits >> 16) | 0x40; the others (bits + 0x7fff + lsb) >> 16 (nearest
  // even). The byte shuffle takes the high halves (the >> 16) and packs them in one go.
  static void store_bf16(uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_andnot_si256(nan, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000));
    store_high_halves(p, _mm256_add_epi32(_mm256_or_si256(u, quiet), bias));
  }
  // F16C widens exactly but quiets signalling NaNs; f16_to_f32 keeps them signalling: clear the
  // quiet bit again where the input was a signalling NaN (0x7c00 < |h| < 0x7e00).
  static F load_f16(const uint16_t* p) {
    const __m128i h = load_u16x8(p);
    const __m256i wide = _mm256_castps_si256(_mm256_cvtph_ps(h));
    const __m256i abs = _mm256_and_si256(_mm256_cvtepu16_epi32(h), _mm256_set1_epi32(0x7fff));
    const __m256i snan = _mm256_and_si256(_mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7c00)),
                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7e00), abs));
    return _mm256_castsi256_ps(
        _mm256_andnot_si256(_mm256_and_si256(snan, _mm256_set1_epi32(0x00400000)), wide));
  }
  // VCVTPS2PH with an immediate round-to-nearest-even: the rounding of f32_to_f16, including
  // subnormals, overflow to inf and NaN -> sign | 0x7e00 | top payload bits.
  static void store_f16(uint16_t* p, F x) {
    store_u16x8(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_top16(uint16_t* p, F x) { store_high_halves(p, _mm256_castps_si256(x)); }

  using NonFinite = __m256i;
  static NonFinite nonfinite_none() { return _mm256_setzero_si256(); }
  static NonFinite nonfinite_add(NonFinite acc, F x) {
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exp);
    return _mm256_or_si256(acc, _mm256_cmpeq_epi32(e, exp));
  }
  static bool nonfinite_any(NonFinite acc) { return !_mm256_testz_si256(acc, acc); }

  struct SquareSums {
    __m256d lane[4];  // lane[k] holds lanes 4k .. 4k+3
  };
  static SquareSums squares_load(const double* lanes) {
    SquareSums s;
    for (int k = 0; k < 4; ++k) s.lane[k] = _mm256_loadu_pd(lanes + 4 * k);
    return s;
  }
  static void squares_store(double* lanes, const SquareSums& s) {
    for (int k = 0; k < 4; ++k) _mm256_storeu_pd(lanes + 4 * k, s.lane[k]);
  }
  static void squares_add16(SquareSums& s, const F* x, double scale) {
    const __m256d sc = _mm256_set1_pd(scale);
    const __m128 quarter[4] = {_mm256_castps256_ps128(x[0]), _mm256_extractf128_ps(x[0], 1),
                               _mm256_castps256_ps128(x[1]), _mm256_extractf128_ps(x[1], 1)};
    for (int k = 0; k < 4; ++k) {
      const __m256d d = _mm256_mul_pd(_mm256_cvtps_pd(quarter[k]), sc);  // exact: 24 x 24 bits
      s.lane[k] = _mm256_fmadd_pd(d, d, s.lane[k]);
    }
  }
};

}  // namespace

const KernelTable* avx2_kernels() {
  static const KernelTable table = make_table<Avx2>(Isa::kAvx2);
  return &table;
}

}  // namespace zinf::kernels::detail
