// The whole model: gradients against finite differences, causality, determinism, gradient
// accumulation, a short training run, sampling.
#include "zinf/gpt/model.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gradcheck.h"
#include "zinf/gpt/data.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

using testing::check_gradient;
using testing::pick_indices;
using testing::Tolerance;

GptConfig tiny() { return preset("tiny").value(); }

struct Batch {
  int batch;
  int seq;
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

Batch text_batch(int batch, int seq, uint64_t step) {
  auto data = TextDataset::from_text(
      "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs.\n",
      "pangrams");
  Batch b{batch, seq, std::vector<int32_t>(batch * seq), std::vector<int32_t>(batch * seq)};
  EXPECT_TRUE(data->sample_batch(7, step, 0, batch, seq, b.tokens.data(), b.targets.data()));
  return b;
}

// GPT-2's forward written out with plain loops in double, reading the tensors by name: an
// independent statement of what the model computes, for logits [B*T, V].
std::vector<double> reference_logits(const GptConfig& cfg, LocalParams& p,
                                     const std::vector<int32_t>& tokens, int batch, int seq) {
  const int d = cfg.dim, hd = cfg.head_dim(), v = cfg.vocab;
  auto tensor = [&](int unit, const char* name) {
    return UnitView(unit_kind(cfg, unit), cfg, p.params(unit).data()).find(name)->data;
  };
  using Mat = std::vector<std::vector<double>>;  // [T][width]
  auto layernorm = [&](const Mat& x, const float* w, const float* b) {
    Mat y = x;
    for (auto& row : y) {
      double mean = 0, var = 0;
      for (double e : row) mean += e / d;
      for (double e : row) var += (e - mean) * (e - mean) / d;
      for (int i = 0; i < d; ++i) row[i] = (row[i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
    }
    return y;
  };
  auto linear = [](const Mat& x, const float* w, const float* b, int in, int out) {
    Mat y(x.size(), std::vector<double>(out));
    for (size_t t = 0; t < x.size(); ++t) {
      for (int o = 0; o < out; ++o) {
        double acc = b ? b[o] : 0.0;
        for (int i = 0; i < in; ++i) acc += x[t][i] * w[int64_t{o} * in + i];
        y[t][o] = acc;
      }
    }
    return y;
  };
  std::vector<double> out;
  for (int b = 0; b < batch; ++b) {
    Mat x(seq, std::vector<double>(d));
    for (int t = 0; t < seq; ++t) {
      for (int i = 0; i < d; ++i) {
        x[t][i] = double{tensor(0, "wte")[int64_t{tokens[b * seq + t]} * d + i]} +
                  tensor(0, "wpe")[int64_t{t} * d + i];
      }
    }
    for (int l = 0; l < cfg.layers; ++l) {
      const int u = 1 + l;
      Mat qkv = linear(layernorm(x, tensor(u, "ln1_w"), tensor(u, "ln1_b")), tensor(u, "qkv_w"),
                       tensor(u, "qkv_b"), d, 3 * d);
      Mat y(seq, std::vector<double>(d, 0.0));
      for (int h = 0; h < cfg.heads; ++h) {
        for (int t = 0; t < seq; ++t) {
          std::vector<double> w(t + 1);
          double max = -1e300, sum = 0;
          for (int j = 0; j <= t; ++j) {
            double dot = 0;
            for (int i = 0; i < hd; ++i) dot += qkv[t][h * hd + i] * qkv[j][d + h * hd + i];
            w[j] = dot / std::sqrt(double(hd));
            max = std::max(max, w[j]);
          }
          for (double& e : w) sum += (e = std::exp(e - max));
          for (int j = 0; j <= t; ++j) {
            for (int i = 0; i < hd; ++i)
              y[t][h * hd + i] += w[j] / sum * qkv[j][2 * d + h * hd + i];
          }
        }
      }
      Mat a = linear(y, tensor(u, "attn_proj_w"), tensor(u, "attn_proj_b"), d, d);
      for (int t = 0; t < seq; ++t) {
        for (int i = 0; i < d; ++i) x[t][i] += a[t][i];
      }
      Mat f = linear(layernorm(x, tensor(u, "ln2_w"), tensor(u, "ln2_b")), tensor(u, "fc_w"),
                     tensor(u, "fc_b"), d, 4 * d);
      for (auto& row : f) {
        for (double& e : row) {
          e = 0.5 * e * (1 + std::tanh(std::sqrt(2 / M_PI) * (e + 0.044715 * e * e * e)));
        }
      }
      Mat m = linear(f, tensor(u, "mlp_proj_w"), tensor(u, "mlp_proj_b"), 4 * d, d);
      for (int t = 0; t < seq; ++t) {
        for (int i = 0; i < d; ++i) x[t][i] += m[t][i];
      }
    }
    const int lnf = cfg.final_norm_unit();
    Mat logits = linear(layernorm(x, tensor(lnf, "lnf_w"), tensor(lnf, "lnf_b")), tensor(0, "wte"),
                        nullptr, d, v);
    for (auto& row : logits) out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

TEST(GptModel, ForwardMatchesAScalarReference) {
  const GptConfig cfg{.vocab = 256, .seq = 12, .dim = 24, .heads = 3, .layers = 2};
  LocalParams p(cfg);
  p.init(11);
  // Larger weights than the initialisation so every part of the network shows in the logits.
  for (int u = 0; u < p.num_units(); ++u) {
    const auto noise =
        testing::random_normal(static_cast<int64_t>(p.params(u).size()), 0, 0.2f, 100 + u);
    for (size_t i = 0; i < noise.size(); ++i) p.params(u)[i] += noise[i];
  }
  const Batch b = text_batch(2, cfg.seq, 12);
  std::vector<float> logits(b.tokens.size() * cfg.vocab);
  Model(cfg).forward_logits(p.params_fn(), b.tokens.data(), b.batch, b.seq, logits.data());
  const auto ref = reference_logits(cfg, p, b.tokens, b.batch, b.seq);
  ASSERT_EQ(ref.size(), logits.size());
  double max_ref = 0;
  for (double r : ref) max_ref = std::max(max_ref, std::abs(r));
  EXPECT_GT(max_ref, 1.0);
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_NEAR(logits[i], ref[i], 2e-5 * max_ref) << "logit " << i;
  }
}

TEST(GptModel, WholeModelGradientMatchesFiniteDifferences) {
  const GptConfig cfg = tiny();
  LocalParams p(cfg);
  p.init(1);
  const Batch b = text_batch(2, 8, 0);
  Model model(cfg);
  const double loss = model.forward_backward(p.params_fn(), p.grads_fn(), b.tokens.data(),
                                             b.targets.data(), b.batch, b.seq);
  EXPECT_NEAR(loss, std::log(256.0), 0.05);  // near-uniform predictions at initialisation
  auto f = [&] {
    return model.forward_loss(p.params_fn(), b.tokens.data(), b.targets.data(), b.batch, b.seq);
  };
  EXPECT_EQ(f(), loss);

  // Elements of every tensor of every unit. The loss is a mean over 16 positions of a model at its
  // real initialisation (weights ~0.02, residual stream ~0.03), so gradients range from 1e-6 to
  // 0.2 and the step must stay small against the residual stream: h = 1e-2 (five-point stencil,
  // gradcheck.h). The worst error observed is about a sixth of atol 5e-6 + rtol 5e-3.
  const Tolerance tol{.atol = 5e-6, .rtol = 5e-3};
  int checked = 0;
  for (int u = 0; u < cfg.num_units(); ++u) {
    UnitView pv(unit_kind(cfg, u), cfg, p.params(u).data());
    UnitView gv(unit_kind(cfg, u), cfg, p.grads(u).data());
    for (size_t i = 0; i < pv.tensors().size(); ++i) {
      const auto& t = pv.tensors()[i];
      checked +=
          check_gradient(unit_name(cfg, u) + "." + t.spec.name, f, t.data, gv.tensors()[i].data,
                         pick_indices(t.spec.numel(), 4, 10 * u + i), 1e-2f, tol)
              .checked;
    }
  }
  EXPECT_GT(checked, 100);

  // The directional derivative along a random direction v over all parameters: sums many
  // gradient elements, so it is large against the noise and checked tightly. The step is small
  // because v moves every parameter at once: at eps = 1e-3 the truncation error is already 0.5%
  // (it falls as eps^2: 0.005% at 1e-4), while the loss noise divided by 2 eps stays near 1e-3.
  std::vector<std::vector<float>> v, saved;
  double g_dot_v = 0.0;
  for (int u = 0; u < cfg.num_units(); ++u) {
    v.push_back(testing::random_normal(static_cast<int64_t>(p.params(u).size()), 0, 1, 500 + u));
    saved.push_back(p.params(u));
    for (size_t i = 0; i < v[u].size(); ++i) g_dot_v += double{v[u][i]} * p.grads(u)[i];
  }
  auto along = [&](float eps) {
    for (int u = 0; u < cfg.num_units(); ++u) {
      for (size_t i = 0; i < v[u].size(); ++i) p.params(u)[i] = saved[u][i] + eps * v[u][i];
    }
    return f();
  };
  const float eps = 1e-4f;
  const double fd = (along(eps) - along(-eps)) / (2.0 * eps);
  along(0.0f);
  EXPECT_NEAR(fd, g_dot_v, 1e-3 * std::abs(g_dot_v)) << "directional derivative";
}

TEST(GptModel, LaterTokensDoNotChangeEarlierLogits) {
  const GptConfig cfg = tiny();
  LocalParams p(cfg);
  p.init(2);
  Batch b = text_batch(2, cfg.seq, 3);
  const int64_t row = cfg.vocab;
  Model model(cfg);
  std::vector<float> before(b.tokens.size() * row), after(before.size());
  model.forward_logits(p.params_fn(), b.tokens.data(), b.batch, b.seq, before.data());
  const int changed = 9;
  b.tokens[changed] = (b.tokens[changed] + 17) % cfg.vocab;  // sequence 0, position 9
  model.forward_logits(p.params_fn(), b.tokens.data(), b.batch, b.seq, after.data());
  for (int t = 0; t < b.seq; ++t) {
    const bool same = std::memcmp(&before[t * row], &after[t * row], row * sizeof(float)) == 0;
    EXPECT_EQ(same, t < changed) << "position " << t;
  }
  // The other sequence is untouched.
  EXPECT_EQ(std::memcmp(&before[b.seq * row], &after[b.seq * row], b.seq * row * sizeof(float)), 0);
}

TEST(GptModel, RunsAreBitIdenticalAndGradientsAccumulate) {
  const GptConfig cfg = tiny();
  const Batch b = text_batch(3, 12, 5);
  auto run = [&](int micro_steps) {
    LocalParams p(cfg);
    p.init(3);
    Model model(cfg);
    double loss = 0;
    for (int i = 0; i < micro_steps; ++i) {
      loss = model.forward_backward(p.params_fn(), p.grads_fn(), b.tokens.data(), b.targets.data(),
                                    b.batch, b.seq);
    }
    std::vector<float> all;
    for (int u = 0; u < p.num_units(); ++u) {
      all.insert(all.end(), p.grads(u).begin(), p.grads(u).end());
    }
    return std::pair{loss, all};
  };
  const auto [loss1, grads1] = run(1);
  const auto [loss1b, grads1b] = run(1);
  EXPECT_EQ(loss1, loss1b);
  EXPECT_EQ(grads1, grads1b);  // bit for bit
  {
    tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    const auto [loss1c, grads1c] = run(1);
    EXPECT_EQ(loss1c, loss1);
    EXPECT_EQ(grads1c, grads1);  // whatever the thread count
  }

  // One-shot helper: same numbers.
  LocalParams p(cfg);
  p.init(3);
  EXPECT_EQ(model_forward_backward(cfg, p.params_fn(), p.grads_fn(), b.tokens.data(),
                                   b.targets.data(), b.batch, b.seq),
            loss1);
  EXPECT_EQ(p.grads(1), std::vector<float>(grads1.begin() + p.grads(0).size(),
                                           grads1.begin() + p.grads(0).size() + p.grads(1).size()));

  // Two micro-steps on the same batch accumulate twice the gradient.
  const auto [loss2, grads2] = run(2);
  EXPECT_EQ(loss2, loss1);
  for (size_t i = 0; i < grads1.size(); ++i) {
    ASSERT_NEAR(grads2[i], 2 * grads1[i], 1e-6f + 1e-5f * std::abs(grads1[i])) << i;
  }

  // loss_scale multiplies every gradient.
  LocalParams q(cfg);
  q.init(3);
  Model(cfg).forward_backward(q.params_fn(), q.grads_fn(), b.tokens.data(), b.targets.data(),
                              b.batch, b.seq, 0.5f);
  for (size_t i = 0; i < q.grads(2).size(); ++i) {
    const float g1 = grads1[p.grads(0).size() + p.grads(1).size() + i];
    ASSERT_NEAR(q.grads(2)[i], 0.5f * g1, 1e-7f + 1e-5f * std::abs(g1));
  }
}

TEST(GptModel, ShortTrainingRunLowersTheLoss) {
  const GptConfig cfg = tiny();
  LocalParams p(cfg);
  p.init(4);
  Model model(cfg);
  // Adam (no weight decay), written out here so the test depends on nothing but the model.
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.99f, eps = 1e-8f;
  std::vector<std::vector<float>> m, v;
  for (int u = 0; u < p.num_units(); ++u) {
    m.emplace_back(p.params(u).size(), 0.0f);
    v.emplace_back(p.params(u).size(), 0.0f);
  }
  const Batch eval = text_batch(8, cfg.seq, 1000);
  auto eval_loss = [&] {
    return model.forward_loss(p.params_fn(), eval.tokens.data(), eval.targets.data(), eval.batch,
                              eval.seq);
  };
  const double initial = eval_loss();
  for (int step = 1; step <= 30; ++step) {
    const Batch b = text_batch(8, cfg.seq, static_cast<uint64_t>(step));
    p.zero_grads();
    model.forward_backward(p.params_fn(), p.grads_fn(), b.tokens.data(), b.targets.data(), b.batch,
                           b.seq);
    const float c1 = 1.0f - std::pow(beta1, static_cast<float>(step));
    const float c2 = 1.0f - std::pow(beta2, static_cast<float>(step));
    for (int u = 0; u < p.num_units(); ++u) {
      for (size_t i = 0; i < p.params(u).size(); ++i) {
        const float g = p.grads(u)[i];
        m[u][i] = beta1 * m[u][i] + (1 - beta1) * g;
        v[u][i] = beta2 * v[u][i] + (1 - beta2) * g * g;
        p.params(u)[i] -= lr * (m[u][i] / c1) / (std::sqrt(v[u][i] / c2) + eps);
      }
    }
  }
  const double final_loss = eval_loss();
  // From ln(256) = 5.55 nats per byte; the pangrams use 29 distinct bytes, so even a unigram fit
  // is far below the start.
  EXPECT_NEAR(initial, std::log(256.0), 0.05);
  EXPECT_LT(final_loss, initial - 2.0)
      << "initial " << initial << ", after 30 steps " << final_loss;
}

TEST(GptModel, GenerationIsDeterministicPerSeed) {
  const GptConfig cfg = tiny();
  LocalParams p(cfg);
  p.init(5);
  SampleOptions o{.sampling = Sampling::kRandom, .temperature = 1.0f, .top_k = 0, .seed = 9};
  const auto a = generate(cfg, p.params_fn(), "hello", 24, o);
  const auto b = generate(cfg, p.params_fn(), "hello", 24, o);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), 24u);
  EXPECT_EQ(*a, *b);
  o.seed = 10;
  EXPECT_NE(*generate(cfg, p.params_fn(), "hello", 24, o), *a);

  // top_k = 1 is greedy; greedy picks the argmax of the last position's logits.
  o.top_k = 1;
  const auto k1 = generate(cfg, p.params_fn(), "hello", 24, o);
  const auto greedy = generate(cfg, p.params_fn(), "hello", 24, {.sampling = Sampling::kGreedy});
  EXPECT_EQ(*k1, *greedy);
  Model model(cfg);
  const std::vector<int32_t> prompt = {'h', 'e', 'l', 'l', 'o'};
  std::vector<float> logits(prompt.size() * cfg.vocab);
  model.forward_logits(p.params_fn(), prompt.data(), 1, static_cast<int>(prompt.size()),
                       logits.data());
  const float* last = &logits[(prompt.size() - 1) * cfg.vocab];
  EXPECT_EQ(static_cast<unsigned char>((*greedy)[0]),
            std::max_element(last, last + cfg.vocab) - last);

  // Longer than the context: the window slides.
  EXPECT_EQ(generate(cfg, p.params_fn(), "", cfg.seq * 2, o)->size(), size_t(cfg.seq * 2));
}

TEST(GptModel, GenerationRejectsBadOptions) {
  const GptConfig cfg = tiny();
  LocalParams p(cfg);
  p.init(6);
  EXPECT_EQ(generate(cfg, p.params_fn(), "x", 4, {.temperature = 0.0f}).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(generate(cfg, p.params_fn(), "x", 4, {.top_k = -1}).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(generate(cfg, p.params_fn(), "x", -1, {}).status().code(), ErrorCode::kInvalidArgument);
  GptConfig small_vocab = cfg;
  small_vocab.vocab = 64;
  LocalParams q(small_vocab);
  const auto r = generate(small_vocab, q.params_fn(), "xyz", 4, {});  // 'x' = 120 >= 64
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("120"), std::string::npos);
}

}  // namespace
}  // namespace zinf::gpt
