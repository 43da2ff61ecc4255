// The GPT's CUDA layers (cuda_layers.h) and GpuModel against the CPU (layers.h, Model), element by
// element: bit-equal where the GPU runs the CPU's operations in the CPU's order (GELU, embedding,
// column sums), within the bounds stated per case where the summation order differs (cuBLAS,
// warp reductions) or the device's expf/exp/log differ from glibc's. Exits 77 (ctest SKIP)
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/cuda_layers.h"
#include "zinf/gpt/gpu_model.h"
#include "zinf/gpt/layers.h"
#include "zinf/gpt/model.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// db += the column sums of dy, rows in order (as layers.cc's matmul_backward adds them).
void column_sums_reference(const std::vector<float>& dy, int64_t rows, int cols,
                           std::vector<float>& db) {
  for (int c = 0; c < cols; ++c) {
    float acc = db[c];
    for (int64_t r = 0; r < rows; ++r) acc += dy[r * cols + c];
    db[c] = acc;
  }
}

class GptLayersOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    gpu_ = cuda::Gpu::create(0, &error);
    ASSERT_NE(gpu_, nullptr) << error;
  }
  void TearDown() override {
    for (void* p : owned_) gpu_->free(p);
    EXPECT_EQ(gpu_->synchronize(), "");
  }

  // A device copy of host data.
  template <typename T>
  T* up(const std::vector<T>& h) {
    auto* d = static_cast<T*>(gpu_->alloc(h.size() * sizeof(T)));
    owned_.push_back(d);
    gpu_->to_device(d, h.data(), h.size() * sizeof(T));
    return d;
  }
  // A device output buffer of n floats filled with NaN: an output the kernel fails to write
  // cannot pass for the CPU's.
  float* poisoned(size_t n) {
    return up(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
  }

  template <typename T>
  std::vector<T> down(const T* d, size_t n) {
    std::vector<T> h(n);
    gpu_->to_host(h.data(), d, n * sizeof(T));
    EXPECT_EQ(gpu_->synchronize(), "");
    return h;
  }

  // With $ZINF_GPU_REPORT set, one JSON line per comparison is appended to that file (the
  // kernel, its bound, the largest error seen): bench/gpu_check.sh puts them in its summary.
  static void report(const char* what, const std::vector<float>& got,
                     const std::vector<float>& want, double atol, double rtol, bool bits) {
    const char* path = std::getenv("ZINF_GPU_REPORT");
    if (path == nullptr || got.size() != want.size()) return;
    double max_abs = 0, max_rel = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      max_abs = std::max(max_abs, err);
      if (want[i] != 0) max_rel = std::max(max_rel, err / std::fabs(static_cast<double>(want[i])));
    }
    if (FILE* f = std::fopen(path, "a")) {
      std::fprintf(f,
                   "{\"kernel\":\"%s\",\"elements\":%zu,\"bound\":\"%s\",\"atol\":%g,"
                   "\"rtol\":%g,\"max_abs_error\":%g,\"max_rel_error\":%g}\n",
                   what, got.size(), bits ? "bit-equal" : "atol + rtol * |cpu|", atol, rtol,
                   max_abs, max_rel);
      std::fclose(f);
    }
  }

  // Every element within atol + rtol * |reference|; reports the worst one.
  static void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                           double atol, double rtol, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    report(what, got, want, atol, rtol, false);
    size_t worst = 0;
    double worst_excess = -1;
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      const double bound = atol + rtol * std::fabs(static_cast<double>(want[i]));
      if (!(err <= bound)) ++bad;
      if (!(err - bound <= worst_excess)) {
        worst_excess = err - bound;
        worst = i;
      }
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                       << " elements outside the bound; worst at " << worst << ": " << got[worst]
                       << " against " << want[worst];
  }
  static void expect_bits(const std::vector<float>& got, const std::vector<float>& want,
                          const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    report(what, got, want, 0, 0, true);
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
        ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", the CPU's " << want[i];
        return;
      }
    }
  }

  std::unique_ptr<cuda::Gpu> gpu_;
  std::vector<void*> owned_;
};

TEST_F(GptLayersOnGpu, GeluIsBitEqual) {
  // Values across GELU's whole range, saturation included.
  const auto x = random_floats(100'003, 1, -30.0f, 30.0f);
  const auto dy = random_floats(x.size(), 2);
  std::vector<float> y(x.size()), dx(x.size());
  gelu_forward(x.data(), static_cast<int64_t>(x.size()), y.data());
  gelu_backward(dy.data(), x.data(), static_cast<int64_t>(x.size()), dx.data());
  float* x_d = up(x);
  float* y_d = poisoned(y.size());
  cuda::gelu_forward(*gpu_, x_d, static_cast<int64_t>(x.size()), y_d);
  expect_bits(down(y_d, x.size()), y, "gelu_forward");
  float* dy_d = up(dy);
  cuda::gelu_backward(*gpu_, dy_d, x_d, static_cast<int64_t>(x.size()), dy_d);  // in place
  expect_bits(down(dy_d, x.size()), dx, "gelu_backward");
}

TEST_F(GptLayersOnGpu, EmbeddingIsBitEqual) {
  const int batch = 3, seq = 17, dim = 40, vocab = 11;  // few tokens: rows share gradient rows
  std::vector<int32_t> tokens(batch * seq);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7) % vocab);
  const auto wte = random_floats(vocab * dim, 3);
  const auto wpe = random_floats(seq * dim, 4);
  const auto dx = random_floats(tokens.size() * dim, 5);
  std::vector<float> x(tokens.size() * dim);
  embedding_forward(tokens.data(), wte.data(), wpe.data(), batch, seq, dim, x.data());
  auto dwte = random_floats(wte.size(), 6);  // accumulated into
  auto dwpe = random_floats(wpe.size(), 7);
  int32_t* tokens_d = up(tokens);
  float* dwte_d = up(dwte);
  float* dwpe_d = up(dwpe);
  embedding_backward(dx.data(), tokens.data(), batch, seq, dim, dwte.data(), dwpe.data());

  float* x_d = poisoned(x.size());
  cuda::embedding_forward(*gpu_, tokens_d, up(wte), up(wpe), batch, seq, dim, x_d);
  expect_bits(down(x_d, x.size()), x, "embedding_forward");
  cuda::embedding_backward(*gpu_, up(dx), tokens_d, batch, seq, dim, dwte_d, dwpe_d);
  expect_bits(down(dwte_d, dwte.size()), dwte, "embedding_backward (wte)");
  expect_bits(down(dwpe_d, dwpe.size()), dwpe, "embedding_backward (wpe)");
}

TEST_F(GptLayersOnGpu, MatmulWithinItsBound) {
  const int64_t rows = 70;
  const int in = 96, out = 136;
  const auto x = random_floats(rows * in, 8);
  const auto w = random_floats(out * in, 9);
  const auto b = random_floats(out, 10);
  const auto dy = random_floats(rows * out, 11);
  std::vector<float> y(rows * out), dx(rows * in);
  auto dw = random_floats(w.size(), 12);
  auto db = random_floats(b.size(), 13);
  float* dw_d = up(dw);
  float* db_d = up(db);
  matmul_forward(x.data(), w.data(), b.data(), rows, in, out, y.data());
  matmul_backward(dy.data(), x.data(), w.data(), rows, in, out, dx.data(), dw.data(), db.data());

  const float* x_d = up(x);
  const float* w_d = up(w);
  float* y_d = poisoned(y.size());
  float* dx_d = poisoned(dx.size());
  cuda::matmul_forward(*gpu_, x_d, w_d, up(b), rows, in, out, y_d);
  cuda::matmul_backward(*gpu_, up(dy), x_d, w_d, rows, in, out, dx_d, dw_d, db_d);
  // fp32 dot products of up to 136 terms of magnitude <= 1, summed in another order: a few ulps
  // of the sum of the terms' magnitudes (<= 136).
  expect_close(down(y_d, y.size()), y, 2e-5, 1e-5, "matmul_forward");
  expect_close(down(dx_d, dx.size()), dx, 2e-5, 1e-5, "matmul_backward (dx)");
  expect_close(down(dw_d, dw.size()), dw, 2e-5, 1e-5, "matmul_backward (dw)");
  expect_bits(down(db_d, db.size()), db, "matmul_backward (db: column sums in row order)");
}

// bf16 and fp16 inputs (tensor cores, fp32 accumulation) against the CPU's fp32 product of the
// same rounded operands: products of 16-bit values are exact in fp32, so the bound is fp32's.
TEST_F(GptLayersOnGpu, MatmulWith16BitInputsWithinItsBound) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const int64_t rows = 70;
    const int in = 96, out = 136;
    auto round = [&](std::vector<float> v) {
      for (float& x : v) {
        x = dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
      }
      return v;
    };
    const auto x = random_floats(rows * in, 30);
    const auto w = random_floats(out * in, 31);
    const auto b = random_floats(out, 32);
    const auto dy = random_floats(rows * out, 33);
    std::vector<float> y(rows * out), dx(rows * in);
    auto dw = random_floats(w.size(), 34);
    auto db = random_floats(b.size(), 35);
    float* dw_d = up(dw);
    float* db_d = up(db);
    const auto xr = round(x), wr = round(w), dyr = round(dy);
    matmul_forward(xr.data(), wr.data(), b.data(), rows, in, out, y.data());
    // db sums the fp32 dy (the column sums do not go through the product).
    matmul_backward(dyr.data(), xr.data(), wr.data(), rows, in, out, dx.data(), dw.data(), nullptr);
    column_sums_reference(dy, rows, out, db);

    gpu_->set_matmul_inputs(dtype);
    const float* x_d = up(x);
    const float* w_d = up(w);
    float* y_d = poisoned(y.size());
    float* dx_d = poisoned(dx.size());
    cuda::matmul_forward(*gpu_, x_d, w_d, up(b), rows, in, out, y_d);
    cuda::matmul_backward(*gpu_, up(dy), x_d, w_d, rows, in, out, dx_d, dw_d, db_d);
    gpu_->set_matmul_inputs(DType::kF32);
    expect_close(down(y_d, y.size()), y, 2e-5, 1e-5, "matmul_forward, 16-bit inputs");
    expect_close(down(dx_d, dx.size()), dx, 2e-5, 1e-5, "matmul_backward (dx), 16-bit inputs");
    expect_close(down(dw_d, dw.size()), dw, 2e-5, 1e-5, "matmul_backward (dw), 16-bit inputs");
    expect_bits(down(db_d, db.size()), db, "matmul_backward (db), 16-bit inputs");
  }
}

TEST_F(GptLayersOnGpu, LayerNormWithinItsBound) {
  const int64_t rows = 45;
  const int dim = 200;
  const auto x = random_floats(rows * dim, 14, -3.0f, 5.0f);
  const auto w = random_floats(dim, 15);
  const auto b = random_floats(dim, 16);
  const auto dy = random_floats(rows * dim, 17);
  std::vector<float> y(rows * dim), mean(rows), rstd(rows);
  layernorm_forward(x.data(), w.data(), b.data(), rows, dim, y.data(), mean.data(), rstd.data());
  const float* x_d = up(x);
  const float* w_d = up(w);
  float* y_d = poisoned(y.size());
  float* mean_d = poisoned(mean.size());
  float* rstd_d = poisoned(rstd.size());
  cuda::layernorm_forward(*gpu_, x_d, w_d, up(b), rows, dim, y_d, mean_d, rstd_d);
  // Row sums in double, in another order: mean and rstd within an ulp or two of fp32.
  expect_close(down(mean_d, rows), mean, 1e-7, 1e-6, "layernorm_forward (mean)");
  expect_close(down(rstd_d, rows), rstd, 0, 1e-6, "layernorm_forward (rstd)");
  expect_close(down(y_d, y.size()), y, 1e-6, 1e-5, "layernorm_forward (y)");

  // The backward from the CPU's mean and rstd, so that dw and db (column sums in row order) are
  // the CPU's bits.
  auto dx = random_floats(rows * dim, 18);  // accumulated into
  auto dw = random_floats(dim, 19);
  auto db = random_floats(dim, 20);
  float* dx_d = up(dx);
  float* dw_d = up(dw);
  float* db_d = up(db);
  layernorm_backward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, dim, dx.data(),
                     dw.data(), db.data());
  cuda::layernorm_backward(*gpu_, up(dy), x_d, w_d, up(mean), up(rstd), rows, dim, dx_d, dw_d,
                           db_d);
  expect_close(down(dx_d, dx.size()), dx, 1e-5, 1e-5, "layernorm_backward (dx)");
  expect_bits(down(dw_d, dw.size()), dw, "layernorm_backward (dw)");
  expect_bits(down(db_d, db.size()), db, "layernorm_backward (db)");
}

TEST_F(GptLayersOnGpu, AttentionWithinItsBound) {
  const int batch = 2, seq = 37, dim = 48, heads = 3;
  const auto qkv = random_floats(int64_t{batch} * seq * 3 * dim, 21, -2.0f, 2.0f);
  const auto dy = random_floats(int64_t{batch} * seq * dim, 22);
  std::vector<float> att(int64_t{batch} * heads * seq * seq), y(int64_t{batch} * seq * dim);
  std::vector<float> dqkv(qkv.size());
  attention_forward(qkv.data(), batch, seq, dim, heads, att.data(), y.data());
  attention_backward(dy.data(), qkv.data(), att.data(), batch, seq, dim, heads, dqkv.data());
  const float* qkv_d = up(qkv);
  float* att_d = poisoned(att.size());
  float* y_d = poisoned(y.size());
  float* dqkv_d = poisoned(dqkv.size());
  cuda::attention_forward(*gpu_, qkv_d, batch, seq, dim, heads, att_d, y_d);
  // Probabilities: scores summed in another order (cuBLAS), expf within 2 ulps, the row sums in
  // another order; zero above the diagonal exactly.
  const auto att_gpu = down(att_d, att.size());
  expect_close(att_gpu, att, 1e-6, 1e-5, "attention_forward (probabilities)");
  for (int64_t m = 0; m < int64_t{batch} * heads; ++m) {
    for (int t = 0; t < seq; ++t) {
      for (int j = t + 1; j < seq; ++j) {
        ASSERT_EQ(att_gpu[(m * seq + t) * seq + j], 0.0f) << "above the diagonal";
      }
    }
  }
  expect_close(down(y_d, y.size()), y, 1e-5, 1e-5, "attention_forward (y)");
  // The backward from the CPU's probabilities.
  cuda::attention_backward(*gpu_, up(dy), qkv_d, up(att), batch, seq, dim, heads, dqkv_d);
  expect_close(down(dqkv_d, dqkv.size()), dqkv, 1e-6, 1e-4, "attention_backward");
}

TEST_F(GptLayersOnGpu, CrossEntropyWithinItsBound) {
  const int64_t rows = 33;
  const int vocab = 300;
  const auto logits = random_floats(rows * vocab, 23, -8.0f, 8.0f);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 37) % vocab);
  std::vector<float> dlogits(logits.size());
  const double loss = crossentropy_forward_backward(logits.data(), targets.data(), rows, vocab,
                                                    0.5f, dlogits.data());
  float* logits_d = up(logits);  // dlogits in place, as the model uses it
  const double loss_gpu = cuda::crossentropy_forward_backward(*gpu_, logits_d, up(targets), rows,
                                                              vocab, 0.5f, logits_d);
  // exp and log in double: the loss agrees to double precision's last digits.
  EXPECT_NEAR(loss_gpu, loss, 1e-12 * std::fabs(loss));
  expect_close(down(logits_d, logits.size()), dlogits, 1e-10, 1e-6, "crossentropy (dlogits)");
}

// The whole model: GpuModel against Model on the same parameters, one micro-step.
TEST_F(GptLayersOnGpu, ModelMatchesTheCpuModel) {
  const GptConfig cfg{.vocab = 64, .seq = 24, .dim = 48, .heads = 4, .layers = 2};
  const int batch = 2, seq = 20;
  LocalParams cpu(cfg);
  cpu.init(42);
  // Weights 10x GPT-2's initialisation: attention far from uniform, so the query and key
  // gradients are not vanishingly small beside the others.
  for (int u = 0; u < cfg.num_units(); ++u) {
    for (float& w : cpu.params(u)) w *= 10.0f;
  }
  std::vector<int32_t> tokens(batch * seq), targets(batch * seq);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 13 + 5) % cfg.vocab);
    targets[i] = static_cast<int32_t>((i * 29 + 3) % cfg.vocab);
  }
  Model model(cfg);
  const double loss = model.forward_backward(cpu.params_fn(), cpu.grads_fn(), tokens.data(),
                                             targets.data(), batch, seq, 1.0f);
  // The model's own conditioning, measured on the CPU: its gradients again with every parameter
  // moved by one ulp (up and down in turn). With weights this large the softmax magnifies
  // rounding: one ulp moves the gradients' L2 by about 4e-5 of their norm and single elements by
  // percents (14 of the embedding's 4224 by more than 1e-3 of themselves), so the GPU, which rounds
  // its sums in another order, is held to a multiple of what one ulp does rather than to a fixed
  // tolerance that only a perfectly conditioned model would meet.
  LocalParams nudged(cfg);
  for (int u = 0; u < cfg.num_units(); ++u) {
    const auto& from = cpu.params(u);
    auto& to = nudged.params(u);
    for (size_t i = 0; i < from.size(); ++i) {
      to[i] = std::nextafter(from[i], i % 2 ? std::numeric_limits<float>::infinity()
                                            : -std::numeric_limits<float>::infinity());
    }
  }
  Model(cfg).forward_backward(nudged.params_fn(), nudged.grads_fn(), tokens.data(), targets.data(),
                              batch, seq, 1.0f);
  constexpr double kUlps = 16;  // the GPU's error may be this many times one ulp's effect

  std::vector<float*> params_d, grads_d;
  for (int u = 0; u < cfg.num_units(); ++u) {
    params_d.push_back(up(cpu.params(u)));
    grads_d.push_back(up(std::vector<float>(cpu.grads(u).size(), 0.0f)));
  }
  cuda::GpuModel gpu_model(cfg, *gpu_);
  const auto loss_gpu = gpu_model.forward_backward(
      [&](int u) -> const float* { return params_d[u]; }, [&](int u) { return grads_d[u]; },
      tokens.data(), targets.data(), batch, seq, 1.0f);
  ASSERT_TRUE(loss_gpu.is_ok()) << loss_gpu.status().message();
  EXPECT_NEAR(*loss_gpu, loss, 1e-5 * loss);
  for (int u = 0; u < cfg.num_units(); ++u) {
    const auto got = down(grads_d[u], cpu.grads(u).size());
    const auto& want = cpu.grads(u);
    const auto& moved = nudged.grads(u);
    report(unit_name(cfg, u).c_str(), got, want, 1e-5, 1e-3, false);
    // Each tensor (the query, key and value thirds of qkv apart): every element within 1e-5 +
    // 1e-3 of itself + kUlps times the largest move one ulp made in the part; and the L2 error
    // within 1e-4 of the part's norm + 1e-5 of the whole tensor's + kUlps times one ulp's L2
    // move, so a wrong small gradient cannot hide under the absolute bound. (The key bias's true
    // gradient is exactly zero, each row of dS summing to zero: both sides are rounding noise
    // there, which the second term covers.)
    int64_t offset = 0;
    for (const ParamSpec& spec : unit_params(unit_kind(cfg, u), cfg)) {
      const bool qkv = spec.name == "qkv_w" || spec.name == "qkv_b";
      const int parts = qkv ? 3 : 1;
      const int64_t part = spec.numel() / parts;
      double whole = 0;
      for (int64_t i = offset; i < offset + spec.numel(); ++i) {
        whole += static_cast<double>(want[i]) * want[i];
      }
      for (int k = 0; k < parts; ++k) {
        const int64_t begin = offset + k * part, end = begin + part;
        double diff = 0, ref = 0, ulp_l2 = 0, ulp_max = 0;
        for (int64_t i = begin; i < end; ++i) {
          const double d = static_cast<double>(got[i]) - want[i];
          const double m = static_cast<double>(moved[i]) - want[i];
          diff += d * d;
          ref += static_cast<double>(want[i]) * want[i];
          ulp_l2 += m * m;
          ulp_max = std::max(ulp_max, std::fabs(m));
        }
        const std::string name = unit_name(cfg, u) + "." + spec.name + " part " +
                                 std::to_string(k) + " of " + std::to_string(parts);
        int64_t bad = 0, worst = begin;
        double worst_excess = -std::numeric_limits<double>::infinity();
        for (int64_t i = begin; i < end; ++i) {
          const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
          const double excess =
              err - (1e-5 + 1e-3 * std::fabs(static_cast<double>(want[i])) + kUlps * ulp_max);
          if (!(excess <= 0)) ++bad;
          if (!(excess <= worst_excess)) {
            worst_excess = excess;
            worst = i;
          }
        }
        EXPECT_EQ(bad, 0) << name << ": " << bad << " elements outside the bound; worst at "
                          << worst << ": " << got[worst] << " against " << want[worst]
                          << " (one ulp moves this part by up to " << ulp_max << ")";
        EXPECT_LE(std::sqrt(diff), 1e-4 * std::sqrt(ref) + 1e-5 * std::sqrt(whole) +
                                       kUlps * std::sqrt(ulp_l2) + 1e-12)
            << name << " (one ulp moves its L2 by " << std::sqrt(ulp_l2) << ")";
      }
      offset += spec.numel();
    }
  }

  // A token outside the vocabulary is an error, not a fault.
  tokens[3] = cfg.vocab;
  const auto bad = gpu_model.forward_loss([&](int u) -> const float* { return params_d[u]; },
                                          tokens.data(), targets.data(), batch, seq);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("token 64 at 3"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace zinf::gpt

int main(int argc, char** argv) {
  if (zinf::gpt::cuda::device_count() == 0) {
    std::puts("no CUDA device: skipping");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
