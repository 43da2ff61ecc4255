// CPU Adam: the element function against a double-precision reference (stated bounds), every
// SIMD path, thread count, size and start offset against the element function (bit for bit),
// inf/NaN detection, and a long trajectory against the double reference.
#include "zinf/kernels/cpu_adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernel_test_util.h"

namespace zinf::kernels {
namespace {

using ktest::GradBuffer;
using ktest::isa_str;
using ktest::same_f32;
using ktest::same_u16;
using ktest::spread;
using ktest::supported_isas;

constexpr double kU = 0x1p-24;  // unit roundoff of binary32

// ---- double-precision reference (PyTorch's formulas) -------------------------------------------

struct RefUpdate {
  double p, m, v;
  // magnitudes for the error bounds: sums of the absolute values of the terms each result adds
  double m_terms, v_terms, p_decayed, update, step_size, denom;
};

RefUpdate reference_update(const AdamConfig& cfg, const AdamStepArgs& a, double grad, double p,
                           double m, double v) {
  const double lr = cfg.lr, b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps, wd = cfg.weight_decay;
  const bool decoupled = cfg.weight_decay_mode == WeightDecayMode::kDecoupled;
  double g = grad * static_cast<double>(a.grad_scale);
  double g_terms = std::fabs(g);
  if (!decoupled) {
    g += wd * p;
    g_terms += std::fabs(wd * p);
  }
  const double pd = decoupled ? p * (1.0 - lr * wd) : p;
  RefUpdate r;
  r.m = b1 * m + (1.0 - b1) * g;
  r.v = b2 * v + (1.0 - b2) * g * g;
  r.m_terms = std::fabs(b1 * m) + (1.0 - b1) * g_terms;
  r.v_terms = std::fabs(b2 * v) + (1.0 - b2) * g_terms * g_terms;
  const double t = static_cast<double>(a.step);
  const double bc1 = cfg.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
  const double bc2 = cfg.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
  r.denom = std::sqrt(r.v) / std::sqrt(bc2) + eps;
  r.step_size = lr / bc1;
  r.update = r.step_size * r.m / r.denom;
  r.p_decayed = pd;
  r.p = pd - r.update;
  return r;
}

// The stated bounds of the fp32 kernel against the exact (double) update of the same fp32 inputs.
// m and v: a few roundings of their own terms (v has no cancellation: all its terms are >= 0).
// p: its own roundings, the update's relative error, and m's absolute error carried through.
double m_bound(const RefUpdate& r) { return 6 * kU * r.m_terms; }
double v_bound(const RefUpdate& r) { return 8 * kU * r.v_terms; }
double p_bound(const RefUpdate& r) {
  return kU * (2 * std::fabs(r.p_decayed) + std::fabs(r.p)) + 8 * kU * std::fabs(r.update) +
         r.step_size * m_bound(r) / r.denom;
}

struct NamedConfig {
  const char* name;
  AdamConfig cfg;
  AdamStepArgs args;
  float grad_lo_exp, grad_hi_exp;  // decades of the raw gradients
};

std::vector<NamedConfig> configs() {
  return {
      {"adamw_step1", {.lr = 1e-3f, .weight_decay = 0.01f}, {.step = 1}, -6, 0},
      {"adamw_step1000", {.lr = 1e-3f, .weight_decay = 0.1f}, {.step = 1000}, -6, 0},
      {"l2_step7",
       {.lr = 1e-3f, .weight_decay = 0.1f, .weight_decay_mode = WeightDecayMode::kL2},
       {.step = 7},
       -6,
       0},
      {"no_bias_correction", {.lr = 2e-3f, .bias_correction = false}, {.step = 3}, -5, 0},
      {"loss_scaled",
       {.lr = 3e-4f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.05f},
       {.step = 50, .grad_scale = 1.0f / 1024},
       -3,
       3},
      {"large_lr", {.lr = 1e-2f, .beta1 = 0.8f, .beta2 = 0.99f}, {.step = 2}, -4, 1},
  };
}

TEST(AdamCoeffs, DerivedInDoubleRoundedOnce) {
  const AdamConfig cfg{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.01f};
  const AdamCoeffs c = adam_coeffs(cfg, {.step = 3, .grad_scale = 0.5f});
  const double b1 = 0.9f, b2 = 0.999f, lr = 1e-3f, wd = 0.01f;
  EXPECT_EQ(c.grad_scale, 0.5f);
  EXPECT_EQ(c.l2_weight_decay, 0.0f);
  EXPECT_EQ(c.one_minus_beta1, static_cast<float>(1 - b1));
  EXPECT_EQ(c.one_minus_beta2, static_cast<float>(1 - b2));
  EXPECT_EQ(c.param_decay, static_cast<float>(1 - lr * wd));
  EXPECT_EQ(c.neg_step_size, static_cast<float>(-lr / (1 - b1 * b1 * b1)));
  EXPECT_EQ(c.inv_sqrt_bias_correction2, static_cast<float>(1 / std::sqrt(1 - b2 * b2 * b2)));

  const AdamCoeffs l2 = adam_coeffs(
      {.weight_decay = 0.1f, .weight_decay_mode = WeightDecayMode::kL2, .bias_correction = false},
      {.step = 5});
  EXPECT_EQ(l2.l2_weight_decay, 0.1f);
  EXPECT_EQ(l2.param_decay, 1.0f);
  EXPECT_EQ(l2.inv_sqrt_bias_correction2, 1.0f);
  EXPECT_EQ(l2.neg_step_size, -1e-3f);
}

TEST(AdamElement, WithinStatedBoundsOfDoubleReference) {
  std::mt19937 rng(7);
  for (const NamedConfig& nc : configs()) {
    const AdamCoeffs c = adam_coeffs(nc.cfg, nc.args);
    double worst_p = 0, worst_m = 0, worst_v = 0;  // error / bound
    for (int i = 0; i < 20000; ++i) {
      const float g = spread(rng, nc.grad_lo_exp, nc.grad_hi_exp);
      float p = spread(rng, -3, 0.5f), m = spread(rng, -6, -1), v = std::fabs(spread(rng, -12, -2));
      if (i % 10 == 0) m = v = 0.0f;  // a first step
      const RefUpdate r = reference_update(nc.cfg, nc.args, g, p, m, v);
      ASSERT_TRUE(adam_element(c, g, p, m, v));
      const double ep = std::fabs(p - r.p), em = std::fabs(m - r.m), ev = std::fabs(v - r.v);
      ASSERT_LE(ep, p_bound(r)) << nc.name << " case " << i << ": p " << p << " vs " << r.p;
      ASSERT_LE(em, m_bound(r)) << nc.name << " case " << i << ": m " << m << " vs " << r.m;
      ASSERT_LE(ev, v_bound(r)) << nc.name << " case " << i << ": v " << v << " vs " << r.v;
      worst_p = std::max(worst_p, ep / p_bound(r));
      worst_m = std::max(worst_m, em / m_bound(r));
      if (r.v_terms > 0) worst_v = std::max(worst_v, ev / v_bound(r));
    }
    RecordProperty(std::string(nc.name) + "_worst_p_over_bound", std::to_string(worst_p));
    RecordProperty(std::string(nc.name) + "_worst_m_over_bound", std::to_string(worst_m));
    RecordProperty(std::string(nc.name) + "_worst_v_over_bound", std::to_string(worst_v));
  }
}

TEST(AdamElement, ReportsNonFiniteScaledGradient) {
  const AdamCoeffs c = adam_coeffs({}, {.step = 1, .grad_scale = 1e10f});
  float p = 1, m = 0, v = 0;
  EXPECT_TRUE(adam_element(c, 1.0f, p, m, v));
  EXPECT_FALSE(adam_element(c, 1e30f, p, m, v));  // finite, but not once scaled
  EXPECT_FALSE(adam_element(c, NAN, p, m, v));
  EXPECT_TRUE(std::isnan(p));
}

// ---- the kernel against the element function ---------------------------------------------------

struct State {
  std::vector<float> p, m, v;
};

State random_state(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = spread(rng, -3, 0.5f);
    s.m[i] = spread(rng, -6, -1);
    s.v[i] = std::fabs(spread(rng, -12, -2));
  }
  return s;
}

GradBuffer random_grads(DType d, size_t n, uint32_t seed, float lo_exp = -6, float hi_exp = 0) {
  std::mt19937 rng(seed);
  GradBuffer g(d, n);
  for (size_t i = 0; i < n; ++i) g.set(i, spread(rng, lo_exp, hi_exp));
  return g;
}

struct Outputs {
  std::vector<float> p, m, v;
  std::vector<uint8_t> copy;
  bool nonfinite = false;
};

// adam_element over every element, in this (test) translation unit: the reference of the kernel.
Outputs element_reference(const AdamConfig& cfg, const AdamStepArgs& args, const State& s,
                          const GradBuffer& g, std::optional<DType> copy) {
  const size_t n = s.p.size();
  Outputs o{s.p, s.m, s.v, std::vector<uint8_t>(copy ? n * dtype_size(*copy) : 0), false};
  const AdamCoeffs c = adam_coeffs(cfg, args);
  for (size_t i = 0; i < n; ++i) {
    if (!adam_element(c, g.get(i), o.p[i], o.m[i], o.v[i])) o.nonfinite = true;
    if (!copy) continue;
    if (*copy == DType::kF32) {
      std::memcpy(o.copy.data() + 4 * i, &o.p[i], 4);
    } else {
      const uint16_t h = *copy == DType::kBF16 ? f32_to_bf16(o.p[i]) : f32_to_f16(o.p[i]);
      std::memcpy(o.copy.data() + 2 * i, &h, 2);
    }
  }
  return o;
}

// adam_step on copies of the state placed `offset` elements into their buffers (so offset 1
// starts every array 4 or 2 bytes past an aligned address).
Outputs run_kernel(const AdamConfig& cfg, const AdamStepArgs& args, const State& s,
                   const GradBuffer& g, std::optional<DType> copy, size_t offset, int threads,
                   Isa isa) {
  const size_t n = s.p.size();
  std::vector<float> p(offset + n), m(offset + n), v(offset + n);
  std::copy(s.p.begin(), s.p.end(), p.begin() + offset);
  std::copy(s.m.begin(), s.m.end(), m.begin() + offset);
  std::copy(s.v.begin(), s.v.end(), v.begin() + offset);
  const size_t gs = dtype_size(g.dtype), cs = copy ? dtype_size(*copy) : 0;
  std::vector<uint8_t> grad((offset + n) * gs), out_copy((offset + n) * cs, 0xAB);
  if (n > 0) std::memcpy(grad.data() + offset * gs, g.bytes.data(), n * gs);
  const AdamTensors t{.param = p.data() + offset,
                      .m = m.data() + offset,
                      .v = v.data() + offset,
                      .grad = grad.data() + offset * gs,
                      .grad_dtype = g.dtype,
                      .param_copy = copy ? out_copy.data() + offset * cs : nullptr,
                      .copy_dtype = copy.value_or(DType::kBF16),
                      .n = n};
  const AdamStats stats = adam_step(cfg, args, t, threads, isa);
  Outputs o;
  o.p.assign(p.begin() + offset, p.end());
  o.m.assign(m.begin() + offset, m.end());
  o.v.assign(v.begin() + offset, v.end());
  o.copy.assign(out_copy.begin() + offset * cs, out_copy.end());
  o.nonfinite = stats.found_nonfinite_grad;
  return o;
}

// Number of elements that differ (NaN == NaN); prints the first few.
size_t count_mismatches(const Outputs& got, const Outputs& want, std::optional<DType> copy,
                        const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.p.size(); ++i) {
    bool ok = same_f32(got.p[i], want.p[i]) && same_f32(got.m[i], want.m[i]) &&
              same_f32(got.v[i], want.v[i]);
    if (copy && *copy == DType::kF32) {
      float a, b;
      std::memcpy(&a, got.copy.data() + 4 * i, 4);
      std::memcpy(&b, want.copy.data() + 4 * i, 4);
      ok = ok && same_f32(a, b);
    } else if (copy) {
      uint16_t a, b;
      std::memcpy(&a, got.copy.data() + 2 * i, 2);
      std::memcpy(&b, want.copy.data() + 2 * i, 2);
      ok = ok && same_u16(a, b, *copy);
    }
    if (!ok && ++bad <= 3) {
      ADD_FAILURE() << what << ": element " << i << " p " << got.p[i] << " vs " << want.p[i]
                    << ", m " << got.m[i] << " vs " << want.m[i] << ", v " << got.v[i] << " vs "
                    << want.v[i];
    }
  }
  return bad;
}

std::string copy_name(std::optional<DType> c) {
  return c ? std::string(dtype_name(*c)) : std::string("none");
}

TEST(CpuAdam, EveryPathSizeOffsetAndThreadCountMatchesElementFunctionBitForBit) {
  const std::vector<size_t> sizes = {0,  1,  7,  8,  9,    15,
                                     16, 17, 31, 33, 1000, 3 * kCpuChunkElems + 77};
  const std::vector<std::optional<DType>> copies = {std::nullopt, DType::kF32, DType::kBF16,
                                                    DType::kF16};
  const NamedConfig nc = configs()[4];  // loss-scaled AdamW: every coefficient is non-trivial
  for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : sizes) {
      const State s = random_state(n, static_cast<uint32_t>(n) + 1);
      const GradBuffer g = random_grads(gd, n, static_cast<uint32_t>(n) + 2, -3, 3);
      for (const auto& copy : copies) {
        const Outputs want = element_reference(nc.cfg, nc.args, s, g, copy);
        for (Isa isa : supported_isas()) {
          for (size_t offset : {0, 1}) {
            for (int threads : {1, 2}) {
              const std::string what =
                  "isa " + isa_str(isa) + " grad " + std::string(dtype_name(gd)) + " copy " +
                  copy_name(copy) + " n " + std::to_string(n) + " offset " +
                  std::to_string(offset) + " threads " + std::to_string(threads);
              const Outputs got = run_kernel(nc.cfg, nc.args, s, g, copy, offset, threads, isa);
              ASSERT_EQ(count_mismatches(got, want, copy, what), 0u) << what;
              ASSERT_FALSE(got.nonfinite) << what;
            }
          }
        }
      }
    }
  }
}

TEST(CpuAdam, EveryConfigMatchesElementFunctionBitForBit) {
  const size_t n = 4099;
  for (const NamedConfig& nc : configs()) {
    const State s = random_state(n, 11);
    const GradBuffer g = random_grads(DType::kF32, n, 12, nc.grad_lo_exp, nc.grad_hi_exp);
    const Outputs want = element_reference(nc.cfg, nc.args, s, g, DType::kBF16);
    for (Isa isa : supported_isas()) {
      const Outputs got = run_kernel(nc.cfg, nc.args, s, g, DType::kBF16, 0, 1, isa);
      EXPECT_EQ(
          count_mismatches(got, want, DType::kBF16, nc.name + std::string(" ") + isa_str(isa)), 0u);
    }
  }
}

TEST(CpuAdam, SpecialValuesMatchElementFunctionBitForBit) {
  // Zeros of both signs, subnormals, huge and tiny values in every array.
  const std::vector<float> specials = {0.0f,   -0.0f,  1e-45f, -1e-45f, 1e-39f, 1e-30f,
                                       1e30f,  -1e30f, 1.0f,   -1.0f,   3e38f,  65504.0f,
                                       1e-20f, 6e-8f,  -6e-5f, 1e-10f,  0.5f,   -2.0f};
  const size_t k = specials.size(), n = k * k;
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  GradBuffer g(DType::kF32, n);
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = specials[i % k];
    s.m[i] = specials[(i / k) % k];
    s.v[i] = std::fabs(specials[(i * 7) % k]);
    g.set(i, specials[i / k]);
  }
  for (const NamedConfig& nc : configs()) {
    for (auto copy : {std::optional<DType>(DType::kBF16), std::optional<DType>(DType::kF16)}) {
      const Outputs want = element_reference(nc.cfg, nc.args, s, g, copy);
      for (Isa isa : supported_isas()) {
        const Outputs got = run_kernel(nc.cfg, nc.args, s, g, copy, 3, 1, isa);
        EXPECT_EQ(count_mismatches(got, want, copy, nc.name + std::string(" ") + isa_str(isa)), 0u);
        EXPECT_EQ(got.nonfinite, want.nonfinite);
      }
    }
  }
}

TEST(CpuAdam, ThreadCountsAndShardSplitsGiveIdenticalBits) {
  const size_t n = 5 * kCpuChunkElems + 123;
  const State s = random_state(n, 21);
  const GradBuffer g = random_grads(DType::kBF16, n, 22);
  const AdamConfig cfg{.weight_decay = 0.01f};
  const AdamStepArgs args{.step = 4};
  const Outputs want = element_reference(cfg, args, s, g, DType::kBF16);
  for (Isa isa : supported_isas()) {
    for (int threads : {0, 1, 2, 3, 4, 7}) {
      const Outputs got = run_kernel(cfg, args, s, g, DType::kBF16, 0, threads, isa);
      EXPECT_EQ(count_mismatches(got, want, DType::kBF16,
                                 isa_str(isa) + " threads " + std::to_string(threads)),
                0u);
    }
    // The same tensor updated as shards cut at arbitrary points (as ZeRO stages cut it).
    Outputs shards{s.p, s.m, s.v, std::vector<uint8_t>(2 * n), false};
    const std::vector<size_t> cuts = {0, 1, 1000, 1001, kCpuChunkElems + 5, 3 * kCpuChunkElems, n};
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const size_t b = cuts[c], e = cuts[c + 1];
      adam_step(cfg, args,
                {.param = shards.p.data() + b,
                 .m = shards.m.data() + b,
                 .v = shards.v.data() + b,
                 .grad = g.at(b),
                 .grad_dtype = g.dtype,
                 .param_copy = shards.copy.data() + 2 * b,
                 .copy_dtype = DType::kBF16,
                 .n = e - b},
                2, isa);
    }
    EXPECT_EQ(count_mismatches(shards, want, DType::kBF16, isa_str(isa) + " shards"), 0u);
  }
}

TEST(CpuAdam, DetectsInfAndNanInGradientsOfEveryDtype) {
  const size_t n = 100;  // 6 AVX-512 vectors and a 4-element tail; 12 AVX2 vectors and 4
  const State s = random_state(n, 31);
  const AdamConfig cfg{.weight_decay = 0.01f};
  struct Special {
    DType dtype;
    uint32_t bits;
  };
  const std::vector<Special> specials = {
      {DType::kF32, 0x7f800000u}, {DType::kF32, 0xff800000u}, {DType::kF32, 0x7fc00000u},
      {DType::kF32, 0x7f800001u}, {DType::kBF16, 0x7f80u},    {DType::kBF16, 0xff80u},
      {DType::kBF16, 0x7fc0u},    {DType::kBF16, 0x7f81u},    {DType::kF16, 0x7c00u},
      {DType::kF16, 0xfc00u},     {DType::kF16, 0x7e00u},     {DType::kF16, 0x7c01u},
  };
  for (const Special& sp : specials) {
    for (size_t pos : {size_t{0}, size_t{9}, size_t{50}, size_t{97}, size_t{99}}) {
      GradBuffer g = random_grads(sp.dtype, n, 32);
      g.set_bits(pos, sp.bits);
      const Outputs want = element_reference(cfg, {.step = 2}, s, g, DType::kF16);
      ASSERT_TRUE(want.nonfinite);
      for (Isa isa : supported_isas()) {
        const std::string what = isa_str(isa) + " " + std::string(dtype_name(sp.dtype)) + " bits " +
                                 std::to_string(sp.bits) + " at " + std::to_string(pos);
        const Outputs got = run_kernel(cfg, {.step = 2}, s, g, DType::kF16, 0, 2, isa);
        EXPECT_TRUE(got.nonfinite) << what;
        EXPECT_EQ(count_mismatches(got, want, DType::kF16, what), 0u);  // others unaffected
      }
    }
  }
  // Finite gradients that overflow once scaled are reported too.
  GradBuffer g = random_grads(DType::kF32, n, 33);
  g.set(42, 1e30f);
  for (Isa isa : supported_isas()) {
    EXPECT_TRUE(
        run_kernel(cfg, {.step = 1, .grad_scale = 1e10f}, s, g, std::nullopt, 0, 1, isa).nonfinite);
    EXPECT_FALSE(run_kernel(cfg, {.step = 1}, s, g, std::nullopt, 0, 1, isa).nonfinite);
  }
}

TEST(CpuAdam, ManyStepsFollowTheDoubleReferenceTrajectory) {
  const size_t n = 4099;
  const int steps = 300;
  const AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  State s = random_state(n, 41);
  for (float& m : s.m) m = 0;
  for (float& v : s.v) v = 0;
  std::vector<double> rp(s.p.begin(), s.p.end()), rm(n, 0.0), rv(n, 0.0);
  std::vector<double> p_terms(n, 0.0);  // sum over steps of |p| + |update|: the scale of p's error
  std::vector<double> m_terms(n, 0.0);  // m's average of |g| instead of g: the scale of m's error
  std::vector<uint16_t> copy(n);
  for (int t = 1; t <= steps; ++t) {
    // A drifting signal plus noise, as real gradients are.
    std::mt19937 rng(1000 + t);
    GradBuffer g(DType::kF32, n);
    for (size_t i = 0; i < n; ++i) g.set(i, 1e-3f * std::sin(0.01f * t + i) + spread(rng, -5, -3));
    const AdamStepArgs args{.step = t};
    adam_step(cfg, args,
              {.param = s.p.data(),
               .m = s.m.data(),
               .v = s.v.data(),
               .grad = g.at(0),
               .param_copy = copy.data(),
               .copy_dtype = DType::kBF16,
               .n = n},
              2);
    for (size_t i = 0; i < n; ++i) {
      const RefUpdate r = reference_update(cfg, args, g.get(i), rp[i], rm[i], rv[i]);
      rp[i] = r.p;
      rm[i] = r.m;
      rv[i] = r.v;
      p_terms[i] += std::fabs(r.p) + std::fabs(r.update);
      m_terms[i] = cfg.beta1 * m_terms[i] + (1.0 - cfg.beta1) * std::fabs(g.get(i));
      ASSERT_EQ(copy[i], f32_to_bf16(s.p[i])) << "step " << t << " element " << i;
    }
  }
  // Bounds on the accumulated deviation, in units of kU: a step rounds each of p, m and v at most a
  // few (<= 4) ulps of its terms. p adds its deviations up over the steps (scale: the sum of |p|
  // and |update|); m and v are exponential averages that forget them at rates 1 - beta1 and
  // 1 - beta2, so theirs are bounded by 4 ulps times min(steps, 1 / (1 - beta)) of their terms.
  const double p_limit = 4.0;
  const double m_limit = 4.0 * std::min<double>(steps, 1.0 / (1.0 - cfg.beta1));
  const double v_limit = 4.0 * std::min<double>(steps, 1.0 / (1.0 - cfg.beta2));
  double worst_p = 0, worst_m = 0, worst_v = 0;
  for (size_t i = 0; i < n; ++i) {
    const double ep = std::fabs(s.p[i] - rp[i]) / (kU * p_terms[i]);
    const double em = std::fabs(s.m[i] - rm[i]) / (kU * m_terms[i]);
    const double ev = std::fabs(s.v[i] - rv[i]) / (kU * std::fabs(rv[i]));
    ASSERT_LE(ep, p_limit) << "element " << i << ": p " << s.p[i] << " vs " << rp[i];
    ASSERT_LE(em, m_limit) << "element " << i << ": m " << s.m[i] << " vs " << rm[i];
    ASSERT_LE(ev, v_limit) << "element " << i << ": v " << s.v[i] << " vs " << rv[i];
    worst_p = std::max(worst_p, ep);
    worst_m = std::max(worst_m, em);
    worst_v = std::max(worst_v, ev);
  }
  // Measured here: p 0.38, m 3.8, v 20 (of limits 4, 40, 1200).
  RecordProperty("worst_p_ulps", std::to_string(worst_p));
  RecordProperty("worst_m_ulps", std::to_string(worst_m));
  RecordProperty("worst_v_ulps", std::to_string(worst_v));
}

TEST(CpuAdam, ZeroLengthTouchesNothing) {
  for (Isa isa : supported_isas()) {
    const AdamStats stats = adam_step({}, {.step = 1}, AdamTensors{}, 0, isa);
    EXPECT_FALSE(stats.found_nonfinite_grad);
    adam_traffic_roofline(AdamTensors{}, 0, isa);
  }
}

TEST(CpuAdam, TrafficRooflineMovesTheSameArraysAndChangesNoValue) {
  const size_t n = 2 * kCpuChunkElems + 5;
  const State s = random_state(n, 51);
  GradBuffer g = random_grads(DType::kF16, n, 52);
  for (Isa isa : supported_isas()) {
    State w = s;
    std::vector<uint16_t> copy(n);
    const AdamTensors t{.param = w.p.data(),
                        .m = w.m.data(),
                        .v = w.v.data(),
                        .grad = g.at(0),
                        .grad_dtype = DType::kF16,
                        .param_copy = copy.data(),
                        .copy_dtype = DType::kF16,
                        .n = n};
    adam_traffic_roofline(t, 2, isa);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_bits(w.p[i]), f32_bits(s.p[i])) << isa_str(isa) << " " << i;
      ASSERT_EQ(f32_bits(w.m[i]), f32_bits(s.m[i]));
      ASSERT_EQ(f32_bits(w.v[i]), f32_bits(s.v[i]));
      ASSERT_EQ(copy[i], f32_bits(s.p[i]) >> 16);
    }
    EXPECT_EQ(adam_step_bytes(t), 28 * n);
  }
  EXPECT_EQ(adam_step_bytes({.grad_dtype = DType::kF32, .n = 10}), 280u);
}

TEST(CpuAdamDeathTest, NegativeThreadsIsABrokenInvariant) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(adam_step({}, {.step = 1}, AdamTensors{}, -1), "threads");
  EXPECT_DEATH(adam_step({}, {.step = 0}, AdamTensors{}, 1), "1-based");
}

}  // namespace
}  // namespace zinf::kernels
