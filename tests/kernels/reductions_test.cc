// Gradient sum of squares (deterministic for any thread count and path), inf/NaN detection and
// in-place scaling, against scalar references.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernel_test_util.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::kernels {
namespace {

using ktest::GradBuffer;
using ktest::isa_str;
using ktest::spread;
using ktest::supported_isas;

GradBuffer random_grads(DType d, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  GradBuffer g(d, n);
  for (size_t i = 0; i < n; ++i) g.set(i, spread(rng, -4, 1));
  return g;
}

// The documented definition, written out plainly: blocks of 1024 from element 0, lane i % 16 with
// a double FMA, the lanes added as the tree lane[i] += lane[i + w] (w = 8, 4, 2, 1), the blocks
// left to right.
double definition_sum_squares(const GradBuffer& g, size_t n, float scale,
                              std::vector<double>* block_sums = nullptr) {
  double total = 0;
  for (size_t b = 0; b < n; b += kSumSquaresBlockElems) {
    double lanes[16] = {};
    for (size_t i = b; i < std::min(n, b + kSumSquaresBlockElems); ++i) {
      const double d = static_cast<double>(g.get(i)) * static_cast<double>(scale);
      lanes[(i - b) % 16] = std::fma(d, d, lanes[(i - b) % 16]);
    }
    for (size_t w = 8; w >= 1; w /= 2) {
      for (size_t t = 0; t < w; ++t) lanes[t] += lanes[t + w];
    }
    if (block_sums) block_sums->push_back(lanes[0]);
    total += lanes[0];
  }
  return total;
}

TEST(GradSumSquares, FollowsItsDefinitionOnEveryPathAndThreadCount) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1023},
                     size_t{1024}, size_t{1025}, size_t{3 * kCpuChunkElems + 1000 + 7}}) {
      const GradBuffer g = random_grads(d, n, static_cast<uint32_t>(n));
      for (float scale : {1.0f, 0.37f}) {
        const double want = definition_sum_squares(g, n, scale);
        for (Isa isa : supported_isas()) {
          for (int threads : {0, 1, 2, 3, 4}) {
            const double got = grad_sum_squares(g.at(0), d, n, scale, threads, isa);
            ASSERT_EQ(got, want) << isa_str(isa) << " " << dtype_name(d) << " n " << n
                                 << " threads " << threads << " scale " << scale;
          }
        }
      }
    }
  }
}

TEST(GradSumSquares, IsAccurate) {
  const size_t n = 2 * kCpuChunkElems + 333;
  const GradBuffer g = random_grads(DType::kF32, n, 5);
  long double exact = 0;
  for (size_t i = 0; i < n; ++i) exact += static_cast<long double>(g.get(i)) * g.get(i);
  const double got = grad_sum_squares(g.at(0), DType::kF32, n);
  EXPECT_LE(std::fabs(static_cast<long double>(got) - exact) / exact, 1e-13L);
}

TEST(GradSumSquares, BlockSumsComposeAcrossShards) {
  const size_t n = 5 * kSumSquaresBlockElems + 100;
  const GradBuffer g = random_grads(DType::kBF16, n, 6);
  std::vector<double> want;
  const double total = definition_sum_squares(g, n, 1.0f, &want);
  ASSERT_EQ(sum_squares_block_count(n), want.size());
  for (Isa isa : supported_isas()) {
    // Two shards cut at a block boundary give the same block sums as the whole tensor.
    std::vector<double> got(want.size());
    const size_t cut = 2 * kSumSquaresBlockElems;
    grad_sum_squares_blocks(g.at(0), DType::kBF16, cut, 1.0f, got.data(), 1, isa);
    grad_sum_squares_blocks(g.at(cut), DType::kBF16, n - cut, 1.0f,
                            got.data() + cut / kSumSquaresBlockElems, 2, isa);
    EXPECT_EQ(got, want) << isa_str(isa);
    double sum = 0;
    for (double b : got) sum += b;
    EXPECT_EQ(sum, total);
  }
  EXPECT_EQ(sum_squares_block_count(0), 0u);
  EXPECT_EQ(sum_squares_block_count(1), 1u);
  EXPECT_EQ(sum_squares_block_count(kSumSquaresBlockElems), 1u);
}

TEST(GradSumSquares, IsNonFiniteIffAGradientIs) {
  const size_t n = 3000;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    GradBuffer g = random_grads(d, n, 7);
    for (Isa isa : supported_isas()) {
      EXPECT_TRUE(std::isfinite(grad_sum_squares(g.at(0), d, n, 1.0f, 2, isa)));
    }
    for (size_t pos : {size_t{0}, size_t{1500}, size_t{n - 1}}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        GradBuffer b = g;
        b.set(pos, bad);
        for (Isa isa : supported_isas()) {
          EXPECT_FALSE(std::isfinite(grad_sum_squares(b.at(0), d, n, 1.0f, 2, isa)))
              << isa_str(isa) << " " << dtype_name(d) << " at " << pos;
        }
      }
    }
  }
}

TEST(GradHasNonfinite, FindsEveryKindAtEveryPosition) {
  struct Special {
    DType dtype;
    uint32_t bits;
  };
  const std::vector<Special> specials = {
      {DType::kF32, 0x7f800000u}, {DType::kF32, 0xff800000u}, {DType::kF32, 0xffc00001u},
      {DType::kF32, 0x7f800001u}, {DType::kBF16, 0x7f80u},    {DType::kBF16, 0xff80u},
      {DType::kBF16, 0x7fc0u},    {DType::kBF16, 0x7f81u},    {DType::kF16, 0x7c00u},
      {DType::kF16, 0xfc00u},     {DType::kF16, 0x7e00u},     {DType::kF16, 0x7c01u},
  };
  const size_t n = kCpuChunkElems + 77;
  for (const Special& sp : specials) {
    GradBuffer g = random_grads(sp.dtype, n, 8);
    for (Isa isa : supported_isas()) EXPECT_FALSE(grad_has_nonfinite(g.at(0), sp.dtype, n, 2, isa));
    for (size_t pos : {size_t{0}, size_t{17}, kCpuChunkElems - 1, kCpuChunkElems, n - 1}) {
      GradBuffer b = g;
      b.set_bits(pos, sp.bits);
      for (Isa isa : supported_isas()) {
        for (int threads : {1, 2}) {
          EXPECT_TRUE(grad_has_nonfinite(b.at(0), sp.dtype, n, threads, isa))
              << isa_str(isa) << " " << dtype_name(sp.dtype) << " bits " << sp.bits << " at "
              << pos;
        }
      }
    }
  }
  // The largest finite values are finite.
  GradBuffer big(DType::kF16, 40);
  for (size_t i = 0; i < 40; ++i) big.set_bits(i, i % 2 ? 0x7bffu : 0xfbffu);
  for (Isa isa : supported_isas())
    EXPECT_FALSE(grad_has_nonfinite(big.at(0), DType::kF16, 40, 1, isa));
  EXPECT_FALSE(grad_has_nonfinite(nullptr, DType::kF32, 0));
}

TEST(ScaleInplace, MatchesScalarRoundingInEveryDtype) {
  const size_t n = kCpuChunkElems + 41;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    const GradBuffer g = random_grads(d, n, 9);
    for (float scale : {0.5f, 1.0f / 3.0f, 1e-3f, 1000.0f}) {
      GradBuffer want = g;
      for (size_t i = 0; i < n; ++i) want.set(i, g.get(i) * scale);
      for (Isa isa : supported_isas()) {
        GradBuffer got = g;
        scale_inplace(got.at(0), d, n, scale, 2, isa);
        ASSERT_EQ(std::memcmp(got.bytes.data(), want.bytes.data(), n * dtype_size(d)), 0)
            << isa_str(isa) << " " << dtype_name(d) << " scale " << scale;
      }
    }
  }
  scale_inplace(nullptr, DType::kF32, 0, 2.0f);
}

}  // namespace
}  // namespace zinf::kernels
