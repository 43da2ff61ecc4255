// The loops of every CPU kernel, written once over a SIMD policy V (private to zinf_kernels).
// Each instruction-set translation unit defines its V in an anonymous namespace and calls
// make_table<V>(); the instantiations therefore have internal linkage (see kernel_table.h's ODR
// rule). V provides, for kW lanes of fp32:
//
//   F                                  the vector type; splat(float)
//   mul, fma, sqrt, div                correctly rounded IEEE operations (adam_update's Math)
//   load_f32/bf16/f16, store_f32/bf16/f16
//                                      exact widening; narrowing rounds to nearest even, keeps NaN
//                                      quiet, bit for bit as zinf/core/dtype.h
//   store_top16(uint16_t*, F)          the high 16 bits of each lane (roofline copy only)
//   NonFinite, nonfinite_none(), nonfinite_add(acc, F), nonfinite_any(acc)
//   SquareSums, squares_load(const double*), squares_store(double*, acc),
//   squares_add16(acc, const F* x, double scale)
//                                      16 lanes of double: lane t += (double(x_t) * scale)^2 with
//                                      one double FMA, for 16 consecutive elements (16 / kW
//                                      vectors); the scalar V (kW = 1) also has
//                                      square_add(double& lane, F x, double scale) for the last,
//                                      partial group
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernel_table.h"

namespace zinf::kernels::detail {

template <DType D>
using DTypeTag = std::integral_constant<DType, D>;
template <CopyKind C>
using CopyTag = std::integral_constant<CopyKind, C>;

template <class Fn>
inline auto visit_dtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::kF32:
      return fn(DTypeTag<DType::kF32>{});
    case DType::kBF16:
      return fn(DTypeTag<DType::kBF16>{});
    case DType::kF16:
      break;
  }
  return fn(DTypeTag<DType::kF16>{});
}

template <class Fn>
inline auto visit_copy(CopyKind c, Fn&& fn) {
  switch (c) {
    case CopyKind::kNone:
      return fn(CopyTag<CopyKind::kNone>{});
    case CopyKind::kF32:
      return fn(CopyTag<CopyKind::kF32>{});
    case CopyKind::kBF16:
      return fn(CopyTag<CopyKind::kBF16>{});
    case CopyKind::kF16:
      break;
  }
  return fn(CopyTag<CopyKind::kF16>{});
}

template <class V, DType D>
inline typename V::F load_as_f32(const void* base, size_t i) {
  if constexpr (D == DType::kF32) {
    return V::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class V, DType D>
inline void store_from_f32(void* base, size_t i, typename V::F x) {
  if constexpr (D == DType::kF32) {
    V::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBF16) {
    V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  } else {
    V::store_f16(static_cast<uint16_t*>(base) + i, x);
  }
}

template <class V>
inline BasicAdamCoeffs<typename V::F> splat_coeffs(const AdamCoeffs& c) {
  BasicAdamCoeffs<typename V::F> s;
  s.grad_scale = V::splat(c.grad_scale);
  s.l2_weight_decay = V::splat(c.l2_weight_decay);
  s.beta1 = V::splat(c.beta1);
  s.one_minus_beta1 = V::splat(c.one_minus_beta1);
  s.beta2 = V::splat(c.beta2);
  s.one_minus_beta2 = V::splat(c.one_minus_beta2);
  s.eps = V::splat(c.eps);
  s.inv_sqrt_bias_correction2 = V::splat(c.inv_sqrt_bias_correction2);
  s.param_decay = V::splat(c.param_decay);
  s.neg_step_size = V::splat(c.neg_step_size);
  return s;
}

// One pass, everything fused: on the CPUs measured (docs/cpu-adam.md) the loop's limit in cache
// is the divider (one sqrt and one div per element), so splitting the conversions into separate
// L1 passes gained nothing.
template <class V, DType G, CopyKind C>
size_t adam_loop(const AdamCoeffs& coeffs, const AdamSpan& s, bool* nonfinite) {
  using F = typename V::F;
  const BasicAdamCoeffs<F> c = splat_coeffs<V>(coeffs);
  // Local copies: stores through the float pointers could otherwise alias `s` and force reloads.
  float* const param = s.param;
  float* const mom1 = s.m;
  float* const mom2 = s.v;
  const void* const grad = s.grad;
  void* const copy = s.copy;
  typename V::NonFinite bad = V::nonfinite_none();
  const size_t done = s.n - s.n % V::kW;
  for (size_t i = 0; i < done; i += V::kW) {
    const F g = load_as_f32<V, G>(grad, i);
    F p = V::load_f32(param + i);
    F m = V::load_f32(mom1 + i);
    F v = V::load_f32(mom2 + i);
    bad = V::nonfinite_add(bad, adam_update<V>(c, g, p, m, v));
    V::store_f32(param + i, p);
    V::store_f32(mom1 + i, m);
    V::store_f32(mom2 + i, v);
    if constexpr (C == CopyKind::kF32) store_from_f32<V, DType::kF32>(copy, i, p);
    if constexpr (C == CopyKind::kBF16) store_from_f32<V, DType::kBF16>(copy, i, p);
    if constexpr (C == CopyKind::kF16) store_from_f32<V, DType::kF16>(copy, i, p);
  }
  if (V::nonfinite_any(bad)) *nonfinite = true;
  return done;
}

// Same loads and stores as adam_loop, arithmetic reduced to one FMA per stream. 16-bit gradients
// are widened by a shift (no conversion work), the copy keeps the top 16 bits.
template <class V, DType G, CopyKind C>
size_t traffic_loop(const AdamSpan& s, float zero_value) {
  using F = typename V::F;
  const F zero = V::splat(zero_value);
  float* const param = s.param;
  float* const mom1 = s.m;
  float* const mom2 = s.v;
  const void* const grad = s.grad;
  void* const copy = s.copy;
  const size_t done = s.n - s.n % V::kW;
  for (size_t i = 0; i < done; i += V::kW) {
    F g;
    if constexpr (G == DType::kF32) {
      g = V::load_f32(static_cast<const float*>(grad) + i);
    } else {
      g = V::load_bf16(static_cast<const uint16_t*>(grad) + i);
    }
    const F p = V::fma(g, zero, V::load_f32(param + i));
    const F m = V::fma(g, zero, V::load_f32(mom1 + i));
    const F v = V::fma(g, zero, V::load_f32(mom2 + i));
    V::store_f32(param + i, p);
    V::store_f32(mom1 + i, m);
    V::store_f32(mom2 + i, v);
    if constexpr (C == CopyKind::kF32) V::store_f32(static_cast<float*>(copy) + i, p);
    if constexpr (C == CopyKind::kBF16 || C == CopyKind::kF16) {
      V::store_top16(static_cast<uint16_t*>(copy) + i, p);
    }
  }
  return done;
}

template <class V, DType D>
size_t sum_squares_loop(const void* x, size_t n, double scale, double* lanes) {
  constexpr size_t kVectors = kSumSquaresLanes / V::kW;
  static_assert(kVectors * V::kW == kSumSquaresLanes);
  typename V::SquareSums acc = V::squares_load(lanes);
  size_t i = 0;
  for (; i + kSumSquaresLanes <= n; i += kSumSquaresLanes) {
    typename V::F xs[kVectors];
    for (size_t k = 0; k < kVectors; ++k) xs[k] = load_as_f32<V, D>(x, i + k * V::kW);
    V::squares_add16(acc, xs, scale);
  }
  V::squares_store(lanes, acc);
  if constexpr (V::kW == 1) {  // the scalar path also takes the last, partial group
    for (; i < n; ++i) V::square_add(lanes[i % kSumSquaresLanes], load_as_f32<V, D>(x, i), scale);
  }
  return i;
}

template <class V, DType D>
size_t has_nonfinite_loop(const void* x, size_t n, bool* found) {
  typename V::NonFinite bad = V::nonfinite_none();
  const size_t done = n - n % V::kW;
  for (size_t i = 0; i < done; i += V::kW) bad = V::nonfinite_add(bad, load_as_f32<V, D>(x, i));
  if (V::nonfinite_any(bad)) *found = true;
  return done;
}

template <class V, DType S, DType D>
size_t cast_loop(const void* src, void* dst, size_t n) {
  const size_t done = n - n % V::kW;
  for (size_t i = 0; i < done; i += V::kW) {
    store_from_f32<V, D>(dst, i, load_as_f32<V, S>(src, i));
  }
  return done;
}

template <class V, DType D>
size_t scale_loop(void* x, size_t n, float scale) {
  const typename V::F s = V::splat(scale);
  const size_t done = n - n % V::kW;
  for (size_t i = 0; i < done; i += V::kW) {
    store_from_f32<V, D>(x, i, V::mul(load_as_f32<V, D>(x, i), s));
  }
  return done;
}

template <class V>
KernelTable make_table(Isa isa) {
  KernelTable t;
  t.isa = isa;
  t.adam = [](const AdamCoeffs& c, const AdamSpan& s, DType grad, CopyKind copy,
              bool* nonfinite) -> size_t {
    return visit_dtype(grad, [&](auto g) {
      return visit_copy(copy, [&](auto k) {
        return adam_loop<V, decltype(g)::value, decltype(k)::value>(c, s, nonfinite);
      });
    });
  };
  t.traffic = [](const AdamSpan& s, DType grad, CopyKind copy, float zero) -> size_t {
    return visit_dtype(grad, [&](auto g) {
      return visit_copy(copy, [&](auto k) {
        return traffic_loop<V, decltype(g)::value, decltype(k)::value>(s, zero);
      });
    });
  };
  t.sum_squares = [](const void* x, DType d, size_t n, double scale, double* lanes) -> size_t {
    return visit_dtype(
        d, [&](auto dt) { return sum_squares_loop<V, decltype(dt)::value>(x, n, scale, lanes); });
  };
  t.has_nonfinite = [](const void* x, DType d, size_t n, bool* found) -> size_t {
    return visit_dtype(
        d, [&](auto dt) { return has_nonfinite_loop<V, decltype(dt)::value>(x, n, found); });
  };
  t.cast = [](const void* src, DType sd, void* dst, DType dd, size_t n) -> size_t {
    return visit_dtype(sd, [&](auto s) {
      return visit_dtype(dd, [&](auto d) {
        return cast_loop<V, decltype(s)::value, decltype(d)::value>(src, dst, n);
      });
    });
  };
  t.scale = [](void* x, DType d, size_t n, float scale) -> size_t {
    return visit_dtype(d, [&](auto dt) { return scale_loop<V, decltype(dt)::value>(x, n, scale); });
  };
  return t;
}

}  // namespace zinf::kernels::detail
