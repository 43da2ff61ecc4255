// zinf train's GPU path (ScopeAdapter over GpuBuffers, UnitScope::params_to_device and
// grads_from_device, GpuModel) on machines without a GPU: trainer.cc built with
// ZINF_GPT_TEST_GPU_MODEL runs it on the CPU device over the host stand-in for the CUDA layers
// (fake_gpu.cc, the CPU layers themselves). Its exported weights must equal the CPU path's byte
// for byte in every stage and offload mode, in fp32 and bf16.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <iterator>
#include <string>

#include "../io/test_dir.h"
#include "zinf/gpt/trainer.h"

namespace zinf::gpt {
extern std::atomic<bool> g_test_gpu_model;
namespace cuda {
int64_t fake_gpu_layers_run();
int64_t fake_gpu_16bit_products();
}  // namespace cuda
namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Mode {
  int stage;
  Tier params, optimizer;
};

TEST(TrainGpuPath, ExportsTheCpuPathsWeightsInEveryStageAndOffloadMode) {
  constexpr Mode kModes[] = {{0, Tier::kDevice, Tier::kDevice},
                             {2, Tier::kDevice, Tier::kHost},
                             {3, Tier::kDevice, Tier::kDevice},
                             {3, Tier::kNvme, Tier::kNvme}};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Mode& m : kModes) {
      const std::string what = std::string(dtype_name(dtype)) + " stage " +
                               std::to_string(m.stage) + " params " +
                               std::string(tier_name(m.params));
      zinf::testing::TempDir nvme, dir;
      TrainOptions o;
      o.model = preset("tiny").value();
      o.model_name = "tiny";
      o.batch = 3;
      o.steps = 4;
      o.ranks = 2;
      o.engine.adam.lr = 1e-2f;
      o.engine.dtype = dtype;
      o.engine.gradient_accumulation_steps = 2;
      o.engine.stage = m.stage;
      o.engine.param_home = m.params;
      o.engine.optimizer_home = m.optimizer;
      o.engine.nvme_paths = {nvme.path()};
      o.export_path = dir.file("cpu.safetensors");
      g_test_gpu_model = false;
      const int64_t before = cuda::fake_gpu_layers_run();
      auto cpu = train(o);
      ASSERT_TRUE(cpu.is_ok()) << what << ": " << cpu.status().to_string();
      ASSERT_EQ(cuda::fake_gpu_layers_run(), before) << what << ": the CPU path ran GPU layers";
      o.export_path = dir.file("gpu.safetensors");
      g_test_gpu_model = true;
      const int64_t products_16bit = cuda::fake_gpu_16bit_products();
      auto gpu = train(o);
      g_test_gpu_model = false;
      ASSERT_TRUE(gpu.is_ok()) << what << ": " << gpu.status().to_string();
      EXPECT_GT(cuda::fake_gpu_layers_run(), before) << what << ": the GPU path did not run";
      // A bf16 run asks the GPU for its products in bf16 (tensor cores); fp32 in fp32.
      EXPECT_EQ(cuda::fake_gpu_16bit_products() > products_16bit, dtype != DType::kF32) << what;
      EXPECT_EQ(file_bytes(dir.file("gpu.safetensors")), file_bytes(dir.file("cpu.safetensors")))
          << what;
      ASSERT_EQ(gpu->steps.size(), cpu->steps.size());
      EXPECT_EQ(gpu->steps.back().loss, cpu->steps.back().loss) << what;
    }
  }
}

}  // namespace
}  // namespace zinf::gpt
