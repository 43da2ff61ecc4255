// Finite-difference checking for the GPT kernels.
//
// Every check perturbs one fp32 element by +-h and +-2h, evaluates a scalar objective (summed in
// double) at the four points and compares the five-point central difference with the analytic
// gradient:
//
//   |fd - analytic| <= atol + rtol * max(|fd|, |analytic|)
//
// The forward passes are fp32, so the objective carries rounding noise of a few ulps of its
// terms, which the difference divides by h; the plain central difference would need a small h to
// keep its O(h^2) truncation error down and so amplify that noise. The five-point stencil's
// O(h^4) truncation error allows a step 5x larger (1e-2 .. 5e-2), where the noise is small.
// Each test states its step and tolerance; they were set at about ten times the worst error
// observed.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace zinf::gpt::testing {

struct Tolerance {
  double atol;
  double rtol;
};

inline std::vector<float> random_normal(int64_t n, float mean, float std, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(mean, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

// sum_i a[i] * r[i] in double: a scalar objective whose gradient w.r.t. a is r.
inline double weighted_sum(const float* a, const std::vector<float>& r) {
  double s = 0.0;
  for (size_t i = 0; i < r.size(); ++i) s += static_cast<double>(a[i]) * r[i];
  return s;
}

// `count` distinct-ish indices in [0, n), always including 0 and n - 1.
inline std::vector<int64_t> pick_indices(int64_t n, int count, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  std::vector<int64_t> idx = {0, n - 1};
  while (static_cast<int>(idx.size()) < count && static_cast<int>(idx.size()) < n) {
    idx.push_back(dist(gen));
  }
  return idx;
}

// Derivative of f() with respect to *x by the five-point stencil
//   f'(x) = (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h + O(h^4),
// on the fp32 points actually evaluated (x+h is rounded; the stencil uses the rounded offsets).
inline double central_difference(const std::function<double()>& f, float* x, float h) {
  const float orig = *x;
  auto at = [&](float offset, double* where) {
    *x = orig + offset;
    *where = static_cast<double>(*x) - orig;
    return f();
  };
  double d1p, d1m, d2p, d2m;
  const double f1p = at(h, &d1p), f1m = at(-h, &d1m), f2p = at(2 * h, &d2p), f2m = at(-2 * h, &d2m);
  *x = orig;
  // With exact offsets (+-h, +-2h) this is the textbook stencil; rounding of x + offset in fp32
  // changes the offsets by at most an ulp of x, which the divided differences absorb.
  const double g1 = (f1p - f1m) / (d1p - d1m);
  const double g2 = (f2p - f2m) / (d2p - d2m);
  return (4.0 * g1 - g2) / 3.0;
}

struct GradCheckStats {
  int checked = 0;
  double max_abs_error = 0.0;
};

// Checks `analytic[i]` against the central difference of f() in x[i] for each i in `indices`.
inline GradCheckStats check_gradient(const std::string& what, const std::function<double()>& f,
                                     float* x, const float* analytic,
                                     const std::vector<int64_t>& indices, float h, Tolerance tol) {
  GradCheckStats stats;
  for (int64_t i : indices) {
    const double fd = central_difference(f, x + i, h);
    const double an = analytic[i];
    const double err = std::abs(fd - an);
    const double bound = tol.atol + tol.rtol * std::max(std::abs(fd), std::abs(an));
    EXPECT_LE(err, bound) << what << "[" << i << "]: finite difference " << fd << ", analytic "
                          << an;
    stats.max_abs_error = std::max(stats.max_abs_error, err);
    ++stats.checked;
  }
  return stats;
}

}  // namespace zinf::gpt::testing
