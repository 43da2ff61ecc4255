// The CUDA layers' matrix products (gemm_plan.h) run here through a column-major BLAS, exactly as
// cuBLAS receives them, and checked against the CPU layers (layers.h): the GPU path's transposes,
// leading dimensions and per-head strides are proven without a GPU.
#include "zinf/gpt/gemm_plan.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "zinf/gpt/layers.h"

namespace zinf::gpt {
namespace {

// What cublasSgemmStridedBatched does with the call, on the CPU.
void run_column_major(const GemmCall& c) {
  for (int i = 0; i < c.count; ++i) {
    cblas_sgemm(CblasColMajor, c.trans_a ? CblasTrans : CblasNoTrans,
                c.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(c.m), static_cast<int>(c.n),
                static_cast<int>(c.k), c.alpha, c.a + i * c.stride_a, static_cast<int>(c.lda),
                c.b + i * c.stride_b, static_cast<int>(c.ldb), c.beta, c.c + i * c.stride_c,
                static_cast<int>(c.ldc));
  }
}

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5 + 1e-5 * std::fabs(want[i])) << what << " element " << i;
  }
}

TEST(GemmPlan, MatmulCallsComputeTheCpuProducts) {
  const int64_t rows = 37;
  const int in = 24, out = 40;
  const auto x = random_floats(rows * in, 1);
  const auto w = random_floats(out * in, 2);
  const auto b = random_floats(out, 3);
  const auto dy = random_floats(rows * out, 4);
  std::vector<float> y(rows * out), dx(rows * in);
  auto dw = random_floats(w.size(), 5);
  auto db = random_floats(b.size(), 6);
  auto dw_plan = dw;
  matmul_forward(x.data(), w.data(), b.data(), rows, in, out, y.data());
  matmul_backward(dy.data(), x.data(), w.data(), rows, in, out, dx.data(), dw.data(), db.data());

  std::vector<float> y_plan(y.size()), dx_plan(dx.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < out; ++c) y_plan[r * out + c] = b[c];  // the bias kernel
  }
  run_column_major(matmul_forward_gemm(x.data(), w.data(), rows, in, out, 1.0f, y_plan.data()));
  run_column_major(matmul_dx_gemm(dy.data(), w.data(), rows, in, out, dx_plan.data()));
  run_column_major(matmul_dw_gemm(dy.data(), x.data(), rows, in, out, dw_plan.data()));
  expect_close(y_plan, y, "forward");
  expect_close(dx_plan, dx, "dx");
  expect_close(dw_plan, dw, "dw (accumulated)");
}

TEST(GemmPlan, AttentionCallsComputeTheCpuAttention) {
  const AttentionShape s{.batch = 3, .seq = 13, .dim = 24, .heads = 4};
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd()));
  const auto qkv = random_floats(int64_t{s.batch} * s.seq * s.ld(), 7);
  const auto dy = random_floats(int64_t{s.batch} * s.seq * s.dim, 8);
  const int64_t att_n = int64_t{s.batch} * s.heads * s.tt();
  std::vector<float> att(att_n), y(int64_t{s.batch} * s.seq * s.dim), dqkv(qkv.size());
  attention_forward(qkv.data(), s.batch, s.seq, s.dim, s.heads, att.data(), y.data());
  attention_backward(dy.data(), qkv.data(), att.data(), s.batch, s.seq, s.dim, s.heads,
                     dqkv.data());

  // Forward as the CUDA layer runs it: scores, the causal softmax, values.
  std::vector<float> att_plan(att_n), y_plan(y.size());
  for (int b = 0; b < s.batch; ++b) {
    run_column_major(attention_scores_gemm(s, qkv.data(), b, scale, att_plan.data()));
  }
  for (int64_t row = 0; row < int64_t{s.batch} * s.heads * s.seq; ++row) {
    const int t = static_cast<int>(row % s.seq);
    float* p = att_plan.data() + row * s.seq;
    float mx = p[0];
    for (int j = 1; j <= t; ++j) mx = std::max(mx, p[j]);
    float sum = 0;
    for (int j = 0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
    for (int j = 0; j < s.seq; ++j) p[j] = j <= t ? p[j] / sum : 0.0f;
  }
  for (int b = 0; b < s.batch; ++b) {
    run_column_major(attention_values_gemm(s, qkv.data(), att_plan.data(), b, y_plan.data()));
  }
  expect_close(att_plan, att, "probabilities");
  expect_close(y_plan, y, "y");

  // Backward: dP and dV, the softmax backward, dQ and dK.
  std::vector<float> dqkv_plan(qkv.size()), ds(int64_t{s.heads} * s.tt());
  for (int b = 0; b < s.batch; ++b) {
    run_column_major(attention_dp_gemm(s, dy.data(), qkv.data(), b, ds.data()));
    run_column_major(attention_dv_gemm(s, att.data(), dy.data(), b, dqkv_plan.data()));
    for (int64_t row = 0; row < int64_t{s.heads} * s.seq; ++row) {
      const int t = static_cast<int>(row % s.seq);
      const float* p = att.data() + int64_t{b} * s.heads * s.tt() + row * s.seq;
      float* d = ds.data() + row * s.seq;
      float dot = 0;
      for (int j = 0; j <= t; ++j) dot += p[j] * d[j];
      for (int j = 0; j < s.seq; ++j) d[j] = j <= t ? p[j] * (d[j] - dot) : 0.0f;
    }
    run_column_major(attention_dq_gemm(s, ds.data(), qkv.data(), b, scale, dqkv_plan.data()));
    run_column_major(attention_dk_gemm(s, ds.data(), qkv.data(), b, scale, dqkv_plan.data()));
  }
  expect_close(dqkv_plan, dqkv, "dqkv");
}

}  // namespace
}  // namespace zinf::gpt
