// Backward of every layer and unit against central finite differences (gradcheck.h).
#include "zinf/gpt/layers.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <vector>

#include "gradcheck.h"
#include "zinf/gpt/params.h"
#include "zinf/gpt/units.h"

namespace zinf::gpt {
namespace {

using testing::check_gradient;
using testing::pick_indices;
using testing::random_normal;
using testing::Tolerance;
using testing::weighted_sum;

// Inputs, parameters and gradients are O(1) here. With h = 5e-2 (gradcheck.h) the worst error
// observed over every test in this file is about a tenth of atol 1e-4 + rtol 1e-3; at h = 1e-2
// the fp32 noise of the block's output alone comes close to it.
constexpr float kStep = 5e-2f;
constexpr Tolerance kLayerTol{.atol = 1e-4, .rtol = 1e-3};

TEST(GptLayers, LayerNormBackward) {
  const int64_t rows = 6;
  const int dim = 16;
  auto x = random_normal(rows * dim, 0.5f, 1.5f, 1);
  auto w = random_normal(dim, 1.0f, 0.3f, 2);
  auto b = random_normal(dim, 0.0f, 0.3f, 3);
  const auto r = random_normal(rows * dim, 0.0f, 1.0f, 4);
  std::vector<float> y(rows * dim), mean(rows), rstd(rows);
  auto f = [&] {
    layernorm_forward(x.data(), w.data(), b.data(), rows, dim, y.data(), mean.data(), rstd.data());
    return weighted_sum(y.data(), r);
  };
  f();
  // Normalised rows: mean 0, variance 1 before the affine part.
  std::vector<float> dx(rows * dim, 0.0f), dw(dim, 0.0f), db(dim, 0.0f);
  layernorm_backward(r.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, dim, dx.data(),
                     dw.data(), db.data());
  check_gradient("dx", f, x.data(), dx.data(), pick_indices(rows * dim, 12, 5), kStep, kLayerTol);
  check_gradient("dw", f, w.data(), dw.data(), pick_indices(dim, 6, 6), kStep, kLayerTol);
  check_gradient("db", f, b.data(), db.data(), pick_indices(dim, 6, 7), kStep, kLayerTol);

  // Gradients accumulate: a second backward doubles them.
  std::vector<float> dx2 = dx, dw2 = dw, db2 = db;
  layernorm_backward(r.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, dim, dx2.data(),
                     dw2.data(), db2.data());
  for (int i = 0; i < dim; ++i) {
    EXPECT_FLOAT_EQ(dw2[i], 2 * dw[i]);
    EXPECT_FLOAT_EQ(db2[i], 2 * db[i]);
  }
  EXPECT_FLOAT_EQ(dx2[3], 2 * dx[3]);
}

TEST(GptLayers, LayerNormForwardNormalises) {
  const int64_t rows = 3;
  const int dim = 64;
  auto x = random_normal(rows * dim, 3.0f, 2.0f, 8);
  std::vector<float> w(dim, 1.0f), b(dim, 0.0f), y(rows * dim), mean(rows), rstd(rows);
  layernorm_forward(x.data(), w.data(), b.data(), rows, dim, y.data(), mean.data(), rstd.data());
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0, sq = 0;
    for (int i = 0; i < dim; ++i) {
      s += y[r * dim + i];
      sq += double{y[r * dim + i]} * y[r * dim + i];
    }
    EXPECT_NEAR(s / dim, 0.0, 1e-5);
    EXPECT_NEAR(sq / dim, 1.0, 1e-3);
  }
}

TEST(GptLayers, MatmulBackward) {
  const int64_t rows = 5;
  const int in = 7;
  const int out = 9;
  auto x = random_normal(rows * in, 0.0f, 1.0f, 10);
  auto w = random_normal(int64_t{out} * in, 0.0f, 0.5f, 11);
  auto b = random_normal(out, 0.0f, 0.5f, 12);
  const auto r = random_normal(rows * out, 0.0f, 1.0f, 13);
  std::vector<float> y(rows * out);
  auto f = [&] {
    matmul_forward(x.data(), w.data(), b.data(), rows, in, out, y.data());
    return weighted_sum(y.data(), r);
  };
  // Forward against a scalar reference.
  f();
  for (int64_t i = 0; i < rows; ++i) {
    for (int o = 0; o < out; ++o) {
      double ref = b[o];
      for (int k = 0; k < in; ++k) ref += double{x[i * in + k]} * w[o * in + k];
      EXPECT_NEAR(y[i * out + o], ref, 1e-5);
    }
  }
  std::vector<float> dx(rows * in, -7.0f), dw(int64_t{out} * in, 0.0f), db(out, 0.0f);
  matmul_backward(r.data(), x.data(), w.data(), rows, in, out, dx.data(), dw.data(), db.data());
  check_gradient("dx", f, x.data(), dx.data(), pick_indices(rows * in, 10, 14), kStep, kLayerTol);
  check_gradient("dw", f, w.data(), dw.data(), pick_indices(out * in, 10, 15), kStep, kLayerTol);
  check_gradient("db", f, b.data(), db.data(), pick_indices(out, 5, 16), kStep, kLayerTol);
}

// Products big enough to be split across threads (by rows of the output for y and dx, by columns
// for dw here, as out < in): against a scalar reference, and bit-identical on one thread.
TEST(GptLayers, LargeMatmulsSplitExactly) {
  const int64_t rows = 1024;
  const int in = 256;
  const int out = 64;
  const auto x = random_normal(rows * in, 0.0f, 1.0f, 17);
  const auto w = random_normal(int64_t{out} * in, 0.0f, 0.1f, 18);
  const auto b = random_normal(out, 0.0f, 0.1f, 19);
  const auto dy = random_normal(rows * out, 0.0f, 1.0f, 20);
  auto run = [&] {
    std::vector<float> y(rows * out), dx(rows * in), dw(int64_t{out} * in, 0.0f), db(out, 0.0f);
    matmul_forward(x.data(), w.data(), b.data(), rows, in, out, y.data());
    matmul_backward(dy.data(), x.data(), w.data(), rows, in, out, dx.data(), dw.data(), db.data());
    return std::vector<std::vector<float>>{y, dx, dw, db};
  };
  const auto got = run();
  for (int64_t r = 0; r < rows; r += 37) {
    for (int o = 0; o < out; ++o) {
      double ref = b[o];
      for (int k = 0; k < in; ++k) ref += double{x[r * in + k]} * w[o * in + k];
      ASSERT_NEAR(got[0][r * out + o], ref, 1e-4) << r << "," << o;
    }
    for (int k = 0; k < in; k += 5) {
      double ref = 0;
      for (int o = 0; o < out; ++o) ref += double{dy[r * out + o]} * w[o * in + k];
      ASSERT_NEAR(got[1][r * in + k], ref, 1e-4) << r << "," << k;
    }
  }
  for (int o = 0; o < out; o += 3) {
    for (int k = 0; k < in; k += 7) {
      double ref = 0;
      for (int64_t r = 0; r < rows; ++r) ref += double{dy[r * out + o]} * x[r * in + k];
      ASSERT_NEAR(got[2][o * in + k], ref, 1e-3) << o << "," << k;
    }
    double ref = 0;
    for (int64_t r = 0; r < rows; ++r) ref += dy[r * out + o];
    ASSERT_NEAR(got[3][o], ref, 1e-3);
  }
  tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
  EXPECT_EQ(run(), got);
}

TEST(GptLayers, GeluBackward) {
  const int64_t n = 64;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = -4.0f + 8.0f * static_cast<float>(i) / (n - 1);
  const auto r = random_normal(n, 0.0f, 1.0f, 20);
  std::vector<float> y(n);
  auto f = [&] {
    gelu_forward(x.data(), n, y.data());
    return weighted_sum(y.data(), r);
  };
  f();
  EXPECT_NEAR(y[n - 1], 4.0f * 0.5f * (1.0f + std::tanh(0.7978845608f * (4.0f + 0.044715f * 64))),
              1e-6);
  std::vector<float> dx(n);
  gelu_backward(r.data(), x.data(), n, dx.data());
  std::vector<int64_t> all(n);
  for (int64_t i = 0; i < n; ++i) all[i] = i;
  check_gradient("dx", f, x.data(), dx.data(), all, kStep, kLayerTol);
  // In place (dx aliasing dy).
  std::vector<float> inplace = r;
  gelu_backward(inplace.data(), x.data(), n, inplace.data());
  EXPECT_EQ(inplace, dx);
}

TEST(GptLayers, AttentionForwardIsCausalSoftmax) {
  const int batch = 2, seq = 5, dim = 8, heads = 2;
  const auto qkv = random_normal(int64_t{batch} * seq * 3 * dim, 0.0f, 1.0f, 30);
  std::vector<float> att(int64_t{batch} * heads * seq * seq), y(int64_t{batch} * seq * dim);
  attention_forward(qkv.data(), batch, seq, dim, heads, att.data(), y.data());
  const int hd = dim / heads;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int t = 0; t < seq; ++t) {
        // Reference: scores against keys 0..t, softmax, weighted values.
        const float* q = &qkv[(int64_t{b} * seq + t) * 3 * dim + h * hd];
        std::vector<double> s(t + 1);
        double max = -1e30;
        for (int j = 0; j <= t; ++j) {
          const float* k = &qkv[(int64_t{b} * seq + j) * 3 * dim + dim + h * hd];
          double dot = 0;
          for (int i = 0; i < hd; ++i) dot += double{q[i]} * k[i];
          s[j] = dot / std::sqrt(double{hd});
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (double& v : s) sum += (v = std::exp(v - max));
        const float* row = &att[((int64_t{b} * heads + h) * seq + t) * seq];
        for (int j = 0; j < seq; ++j) {
          EXPECT_NEAR(row[j], j <= t ? s[j] / sum : 0.0, 1e-6) << b << " " << h << " " << t;
        }
        for (int i = 0; i < hd; ++i) {
          double ref = 0;
          for (int j = 0; j <= t; ++j) {
            ref += s[j] / sum * qkv[(int64_t{b} * seq + j) * 3 * dim + 2 * dim + h * hd + i];
          }
          EXPECT_NEAR(y[(int64_t{b} * seq + t) * dim + h * hd + i], ref, 1e-5);
        }
      }
    }
  }
}

TEST(GptLayers, AttentionBackward) {
  const int batch = 2, seq = 5, dim = 8, heads = 2;
  auto qkv = random_normal(int64_t{batch} * seq * 3 * dim, 0.0f, 1.0f, 31);
  const auto r = random_normal(int64_t{batch} * seq * dim, 0.0f, 1.0f, 32);
  std::vector<float> att(int64_t{batch} * heads * seq * seq), y(int64_t{batch} * seq * dim);
  auto f = [&] {
    attention_forward(qkv.data(), batch, seq, dim, heads, att.data(), y.data());
    return weighted_sum(y.data(), r);
  };
  f();
  std::vector<float> dqkv(qkv.size(), 123.0f);
  attention_backward(r.data(), qkv.data(), att.data(), batch, seq, dim, heads, dqkv.data());
  // Every element: queries, keys and values of both heads and both sequences.
  std::vector<int64_t> all(qkv.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  check_gradient("dqkv", f, qkv.data(), dqkv.data(), all, kStep, kLayerTol);
}

TEST(GptLayers, EmbeddingBackwardAccumulatesRepeatedTokens) {
  const int batch = 2, seq = 4, dim = 6, vocab = 5;
  const std::vector<int32_t> tokens = {1, 3, 1, 1, 4, 0, 3, 1};  // token 1 four times
  auto wte = random_normal(int64_t{vocab} * dim, 0.0f, 1.0f, 40);
  auto wpe = random_normal(int64_t{seq} * dim, 0.0f, 1.0f, 41);
  const auto r = random_normal(int64_t{batch} * seq * dim, 0.0f, 1.0f, 42);
  std::vector<float> x(r.size());
  auto f = [&] {
    embedding_forward(tokens.data(), wte.data(), wpe.data(), batch, seq, dim, x.data());
    return weighted_sum(x.data(), r);
  };
  f();
  EXPECT_EQ(x[5 * dim + 2], wte[0 * dim + 2] + wpe[1 * dim + 2]);
  std::vector<float> dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f);
  embedding_backward(r.data(), tokens.data(), batch, seq, dim, dwte.data(), dwpe.data());
  std::vector<int64_t> all_te(wte.size()), all_pe(wpe.size());
  for (size_t i = 0; i < all_te.size(); ++i) all_te[i] = static_cast<int64_t>(i);
  for (size_t i = 0; i < all_pe.size(); ++i) all_pe[i] = static_cast<int64_t>(i);
  check_gradient("dwte", f, wte.data(), dwte.data(), all_te, kStep, kLayerTol);
  check_gradient("dwpe", f, wpe.data(), dwpe.data(), all_pe, kStep, kLayerTol);
  // Token 2 never appears: its row stays zero.
  for (int i = 0; i < dim; ++i) EXPECT_EQ(dwte[2 * dim + i], 0.0f);
}

TEST(GptLayers, CrossEntropyBackward) {
  const int64_t rows = 6;
  const int vocab = 11;
  auto logits = random_normal(rows * vocab, 0.0f, 2.0f, 50);
  const std::vector<int32_t> targets = {0, 10, 3, 3, 7, 5};
  auto f = [&] {
    return crossentropy_forward_backward(logits.data(), targets.data(), rows, vocab, 1.0f, nullptr);
  };
  // The loss against a reference in double.
  double ref = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int j = 0; j < vocab; ++j) s += std::exp(double{logits[r * vocab + j]});
    ref += std::log(s) - logits[r * vocab + targets[r]];
  }
  EXPECT_NEAR(f(), ref / rows, 1e-6);
  const float scale = 0.25f;
  std::vector<float> d(logits.size());
  const double loss =
      crossentropy_forward_backward(logits.data(), targets.data(), rows, vocab, scale, d.data());
  EXPECT_EQ(loss, f());
  for (float& v : d) v /= scale;
  std::vector<int64_t> all(logits.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  // The mean loss has gradients of order 1/rows.
  check_gradient("dlogits", f, logits.data(), d.data(), all, kStep, {.atol = 1e-5, .rtol = 1e-3});
}

// ---- units ----

GptConfig unit_test_config() { return {.vocab = 13, .seq = 6, .dim = 8, .heads = 2, .layers = 2}; }

// Random parameters for a unit, larger than the real initialisation so that every path (the
// attention pattern, the GELU curvature, the layer-norm gains) has gradients of order one.
std::vector<float> random_unit_params(const GptConfig& cfg, UnitKind kind, uint64_t seed) {
  std::vector<float> p(static_cast<size_t>(unit_numel(kind, cfg)));
  UnitView view(kind, cfg, p.data());
  uint64_t s = seed;
  for (const UnitView::Tensor& t : view.tensors()) {
    const float mean = t.spec.init == Init::kOnes ? 1.0f : 0.0f;
    const float std = t.spec.init == Init::kNormal ? 0.3f : 0.2f;
    const auto v = random_normal(t.spec.numel(), mean, std, ++s);
    std::copy(v.begin(), v.end(), t.data);
  }
  return p;
}

// Checks a few elements of every tensor of a unit's gradient buffer.
void check_unit_gradients(const GptConfig& cfg, UnitKind kind, const std::function<double()>& f,
                          std::vector<float>& params, const std::vector<float>& grads,
                          Tolerance tol, uint64_t seed) {
  UnitView pv(kind, cfg, params.data());
  UnitView gv(kind, cfg, const_cast<float*>(grads.data()));
  for (size_t i = 0; i < pv.tensors().size(); ++i) {
    const auto& t = pv.tensors()[i];
    check_gradient(t.spec.name, f, t.data, gv.tensors()[i].data,
                   pick_indices(t.spec.numel(), 6, seed + i), kStep, tol);
  }
}

TEST(GptUnits, BlockBackward) {
  const GptConfig cfg = unit_test_config();
  const int batch = 2, seq = 5;
  const int64_t n = int64_t{batch} * seq * cfg.dim;
  auto params = random_unit_params(cfg, UnitKind::kBlock, 100);
  auto x = random_normal(n, 0.0f, 1.0f, 101);
  const auto r = random_normal(n, 0.0f, 1.0f, 102);
  BlockActivations acts;
  std::vector<float> y(n);
  auto f = [&] {
    block_forward(cfg, params.data(), x.data(), batch, seq, y.data(), acts);
    return weighted_sum(y.data(), r);
  };
  f();
  std::vector<float> grads(params.size(), 0.0f), dx(n);
  BlockWorkspace ws;
  block_backward(cfg, params.data(), acts, r.data(), dx.data(), grads.data(), ws);
  check_gradient("dx_in", f, x.data(), dx.data(), pick_indices(n, 16, 103), kStep, kLayerTol);
  check_unit_gradients(cfg, UnitKind::kBlock, f, params, grads, kLayerTol, 104);

  // In place (x_out = x_in, dx_in = dx_out) gives the same numbers.
  f();  // y as of the unperturbed parameters
  std::vector<float> xy = x;
  block_forward(cfg, params.data(), xy.data(), batch, seq, xy.data(), acts);
  EXPECT_EQ(xy, y);
  std::vector<float> grads2(params.size(), 0.0f), d = r;
  block_backward(cfg, params.data(), acts, d.data(), d.data(), grads2.data(), ws);
  EXPECT_EQ(d, dx);
  EXPECT_EQ(grads2, grads);
}

TEST(GptUnits, EmbeddingBackward) {
  const GptConfig cfg = unit_test_config();
  const int batch = 2, seq = 6;
  const int64_t n = int64_t{batch} * seq * cfg.dim;
  const std::vector<int32_t> tokens = {0, 12, 5, 5, 1, 2, 3, 5, 7, 12, 0, 9};
  auto params = random_unit_params(cfg, UnitKind::kEmbedding, 200);
  const auto r = random_normal(n, 0.0f, 1.0f, 201);
  std::vector<float> x(n);
  auto f = [&] {
    embedding_forward(cfg, params.data(), tokens.data(), batch, seq, x.data());
    return weighted_sum(x.data(), r);
  };
  f();
  std::vector<float> grads(params.size(), 0.0f);
  embedding_backward(cfg, r.data(), tokens.data(), batch, seq, grads.data());
  check_unit_gradients(cfg, UnitKind::kEmbedding, f, params, grads, kLayerTol, 202);
}

TEST(GptUnits, FinalNormAndTiedHeadBackward) {
  const GptConfig cfg = unit_test_config();
  const int batch = 2, seq = 4;
  const int64_t rows = int64_t{batch} * seq;
  const int64_t n = rows * cfg.dim;
  auto lnf = random_unit_params(cfg, UnitKind::kFinalNorm, 300);
  auto emb = random_unit_params(cfg, UnitKind::kEmbedding, 301);
  auto x = random_normal(n, 0.0f, 1.0f, 302);
  const std::vector<int32_t> targets = {3, 0, 12, 7, 7, 1, 4, 9};
  FinalNormActivations acts;
  HeadWorkspace ws;
  auto f = [&] {
    final_norm_forward(cfg, lnf.data(), x.data(), batch, seq, acts);
    return head_loss(cfg, emb.data(), acts.out.data(), targets.data(), rows, ws);
  };
  const double loss0 = f();
  std::vector<float> lnf_grads(lnf.size(), 0.0f), emb_grads(emb.size(), 0.0f), dx(n);
  const double loss =
      head_forward_backward(cfg, lnf.data(), lnf_grads.data(), emb.data(), emb_grads.data(),
                            x.data(), targets.data(), batch, seq, 1.0f, dx.data(), acts, ws);
  EXPECT_EQ(loss, loss0);
  // A mean over 8 rows: gradients of order 0.1.
  const Tolerance tol{.atol = 2e-5, .rtol = 1e-3};
  check_gradient("dx", f, x.data(), dx.data(), pick_indices(n, 16, 303), kStep, tol);
  check_unit_gradients(cfg, UnitKind::kFinalNorm, f, lnf, lnf_grads, tol, 304);
  // The head reaches wte only; wpe's gradient is embedding_backward's business.
  UnitView ev(UnitKind::kEmbedding, cfg, emb.data());
  const auto wte = ev.find("wte").value();
  check_gradient("wte (head)", f, wte.data, emb_grads.data() + wte.offset,
                 pick_indices(wte.spec.numel(), 16, 305), kStep, tol);
  const auto wpe = ev.find("wpe").value();
  for (int64_t i = 0; i < wpe.spec.numel(); ++i) EXPECT_EQ(emb_grads[wpe.offset + i], 0.0f);
}

}  // namespace
}  // namespace zinf::gpt
