// GpuModel's orchestration on the CPU: linked with fake_gpu.cc (cuda_layers.h on the host through
// the CPU layers), it must give Model's loss and every unit's gradients bit for bit, since the
// layers are the same; any difference is GpuModel's own (a layer skipped, a wrong buffer, alias or
// copy, a gradient not accumulated). The CUDA kernels are compared with the CPU in tests/gpu.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "zinf/gpt/gpu_model.h"
#include "zinf/gpt/model.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

TEST(GpuModelOnCpu, MatchesModelBitForBitOverMicroSteps) {
  const GptConfig cfg{.vocab = 64, .seq = 24, .dim = 48, .heads = 4, .layers = 3};
  LocalParams cpu(cfg);
  cpu.init(7);
  LocalParams dev(cfg);  // the "device" copies: the same values
  for (int u = 0; u < cfg.num_units(); ++u) dev.params(u) = cpu.params(u);
  std::string error;
  auto gpu = cuda::Gpu::create(0, &error);
  ASSERT_NE(gpu, nullptr) << error;
  Model model(cfg);
  cuda::GpuModel gpu_model(cfg, *gpu);
  // Two micro-steps of different lengths into the same gradients (accumulation, and buffers
  // resized between them), with a loss scale.
  for (const auto& [batch, seq] : {std::pair{2, 20}, std::pair{3, 11}}) {
    std::vector<int32_t> tokens(batch * seq), targets(batch * seq);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 13 + seq) % cfg.vocab);
      targets[i] = static_cast<int32_t>((i * 29 + 3) % cfg.vocab);
    }
    const double loss = model.forward_backward(cpu.params_fn(), cpu.grads_fn(), tokens.data(),
                                               targets.data(), batch, seq, 0.5f);
    std::vector<int> asked;
    const auto got = gpu_model.forward_backward(
        [&](int u) -> const float* {
          asked.push_back(u);
          return dev.params(u).data();
        },
        dev.grads_fn(), tokens.data(), targets.data(), batch, seq, 0.5f);
    ASSERT_TRUE(got.is_ok()) << got.status().message();
    EXPECT_EQ(std::memcmp(&*got, &loss, sizeof loss), 0) << *got << " vs " << loss;
    // Model's callback order (model.h): forward 0..L+1, the head's 0, then L+1 and L..1.
    const std::vector<int> order{0, 1, 2, 3, 4, 0, 4, 3, 2, 1};
    EXPECT_EQ(asked, order);
  }
  for (int u = 0; u < cfg.num_units(); ++u) {
    ASSERT_EQ(dev.grads(u).size(), cpu.grads(u).size());
    EXPECT_EQ(std::memcmp(dev.grads(u).data(), cpu.grads(u).data(), dev.grads(u).size() * 4), 0)
        << unit_name(cfg, u) << ": gradients differ from Model's";
  }
  // forward_loss too, and a bad target is an error naming it.
  std::vector<int32_t> tokens(16, 1), targets(16, 2);
  const double loss = model.forward_loss(cpu.params_fn(), tokens.data(), targets.data(), 1, 16);
  const auto got = gpu_model.forward_loss(dev.params_fn(), tokens.data(), targets.data(), 1, 16);
  ASSERT_TRUE(got.is_ok());
  EXPECT_EQ(*got, loss);
  targets[5] = -1;
  const auto bad = gpu_model.forward_loss(dev.params_fn(), tokens.data(), targets.data(), 1, 16);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("target -1 at 5"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace zinf::gpt
