// CudaDevice against the CPU device, operation by operation, element by element: the same inputs
// (random values with zeros, subnormals, huge values, inf and NaN mixed in), every dtype pair,
// and the bits compared (the kernels share the CPU's conversions, Adam element function and
// sum-of-squares lanes, so they must be equal; a NaN need only be a NaN). Exits 77 (ctest SKIP)
// where no GPU is present.
#include "zinf/kernels/cuda_device.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/device.h"

namespace zinf {
namespace {

constexpr uint64_t kN = 100'003;  // not a multiple of any block or lane count

// kN elements of `dtype` (raw bytes) from random floats with special values mixed in.
std::vector<char> values(DType dtype, uint64_t seed, uint64_t n = kN) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> f(n);
  const float specials[] = {0.0f,
                            -0.0f,
                            1e-40f,
                            -1e-42f,
                            65504.0f,
                            7e4f,
                            3e38f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (uint64_t i = 0; i < n; ++i) {
    f[i] = i % 97 == 0 ? specials[(i / 97) % std::size(specials)] : normal(rng);
  }
  std::vector<char> out(n * dtype_size(dtype));
  kernels::cast(f.data(), DType::kF32, out.data(), dtype, n, 1);
  return out;
}

// Finite values only (for Adam state, whose NaN payloads are not part of the contract).
std::vector<char> finite_values(DType dtype, uint64_t seed) {
  std::vector<char> v = values(DType::kF32, seed);
  auto* f = reinterpret_cast<float*>(v.data());
  for (uint64_t i = 0; i < kN; ++i) {
    if (!std::isfinite(f[i]) || std::fabs(f[i]) > 1e4f) f[i] = 0.5f;
  }
  std::vector<char> out(kN * dtype_size(dtype));
  kernels::cast(f, DType::kF32, out.data(), dtype, kN, 1);
  return out;
}

struct Pair {
  std::unique_ptr<Device> cpu, gpu;
  std::unique_ptr<Stream> cs, gs;
};

Pair devices() {
  Pair p;
  p.cpu = make_device(DeviceKind::kCpu, {.budget_bytes = 1ull << 30}).value();
  p.gpu = make_device(DeviceKind::kCuda, {.budget_bytes = 1ull << 30}).value();
  p.cs = p.cpu->create_stream("cpu");
  p.gs = p.gpu->create_stream("gpu");
  return p;
}

// A device buffer holding `bytes` of host data, and reading it back.
DeviceBuffer upload(Device& d, Stream& s, const std::vector<char>& host) {
  DeviceBuffer b = d.allocate(host.size(), MemoryCategory::kBuffers).value();
  d.copy_async(b.data(), host.data(), host.size(), s);
  EXPECT_TRUE(s.synchronize().is_ok());
  return b;
}
std::vector<char> download(Device& d, Stream& s, const DeviceBuffer& b, uint64_t bytes) {
  std::vector<char> host(bytes);
  d.copy_async(host.data(), b.data(), bytes, s);
  EXPECT_TRUE(s.synchronize().is_ok());
  return host;
}

void expect_same_bits(const std::vector<char>& cpu, const std::vector<char>& gpu, DType dtype,
                      const char* what) {
  ASSERT_EQ(cpu.size(), gpu.size());
  const uint64_t w = dtype_size(dtype), n = cpu.size() / w;
  uint64_t differing = 0, first = n;
  for (uint64_t i = 0; i < n; ++i) {
    if (std::memcmp(cpu.data() + i * w, gpu.data() + i * w, w) == 0) continue;
    // A NaN is a NaN: its sign and payload are not part of the contract (x86 passes an input
    // NaN's through arithmetic, a GPU returns its canonical one).
    float c, g;
    kernels::cast(cpu.data() + i * w, dtype, &c, DType::kF32, 1, 1);
    kernels::cast(gpu.data() + i * w, dtype, &g, DType::kF32, 1, 1);
    if (std::isnan(c) && std::isnan(g)) continue;
    if (differing++ == 0) first = i;
  }
  EXPECT_EQ(differing, 0u) << what << " (" << dtype_name(dtype) << "): " << differing
                           << " elements differ, the first at " << first;
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(CudaDevice, FillCastScaleAccumulateAreBitEqual) {
  Pair p = devices();
  for (DType dst : kDTypes) {
    // fill
    for (float value : {0.0f, -1.5f, 3e38f}) {
      DeviceBuffer c = p.cpu->allocate(kN * dtype_size(dst), MemoryCategory::kBuffers).value();
      DeviceBuffer g = p.gpu->allocate(kN * dtype_size(dst), MemoryCategory::kBuffers).value();
      p.cpu->fill({c.data(), dst, kN}, value, *p.cs);
      p.gpu->fill({g.data(), dst, kN}, value, *p.gs);
      expect_same_bits(download(*p.cpu, *p.cs, c, c.bytes()), download(*p.gpu, *p.gs, g, g.bytes()),
                       dst, "fill");
    }
    for (DType src : kDTypes) {
      const std::vector<char> in = values(src, 11);
      // cast
      DeviceBuffer ci = upload(*p.cpu, *p.cs, in), gi = upload(*p.gpu, *p.gs, in);
      DeviceBuffer co = p.cpu->allocate(kN * dtype_size(dst), MemoryCategory::kBuffers).value();
      DeviceBuffer go = p.gpu->allocate(kN * dtype_size(dst), MemoryCategory::kBuffers).value();
      p.cpu->cast({co.data(), dst, kN}, {ci.data(), src, kN}, *p.cs);
      p.gpu->cast({go.data(), dst, kN}, {gi.data(), src, kN}, *p.gs);
      expect_same_bits(download(*p.cpu, *p.cs, co, kN * dtype_size(dst)),
                       download(*p.gpu, *p.gs, go, kN * dtype_size(dst)), dst, "cast");
    }
    // scale, with the non-finite flag
    for (float factor : {0.5f, 1024.0f}) {
      const std::vector<char> in = values(dst, 12);
      DeviceBuffer c = upload(*p.cpu, *p.cs, in), g = upload(*p.gpu, *p.gs, in);
      bool cpu_bad = false, gpu_bad = false;
      p.cpu->scale({c.data(), dst, kN}, factor, &cpu_bad, *p.cs);
      p.gpu->scale({g.data(), dst, kN}, factor, &gpu_bad, *p.gs);
      expect_same_bits(download(*p.cpu, *p.cs, c, in.size()), download(*p.gpu, *p.gs, g, in.size()),
                       dst, "scale");
      EXPECT_EQ(cpu_bad, gpu_bad);
      EXPECT_TRUE(gpu_bad);  // the inputs hold inf and NaN
    }
  }
  // accumulate: fp32 accumulator, any source dtype, with and without overwrite
  for (DType src : kDTypes) {
    for (bool overwrite : {false, true}) {
      const std::vector<char> acc = values(DType::kF32, 13), in = values(src, 14);
      DeviceBuffer ca = upload(*p.cpu, *p.cs, acc), ga = upload(*p.gpu, *p.gs, acc);
      DeviceBuffer ci = upload(*p.cpu, *p.cs, in), gi = upload(*p.gpu, *p.gs, in);
      p.cpu->accumulate({ca.data(), DType::kF32, kN}, {ci.data(), src, kN}, overwrite, *p.cs);
      p.gpu->accumulate({ga.data(), DType::kF32, kN}, {gi.data(), src, kN}, overwrite, *p.gs);
      expect_same_bits(download(*p.cpu, *p.cs, ca, acc.size()),
                       download(*p.gpu, *p.gs, ga, acc.size()), DType::kF32, "accumulate");
    }
  }
}

TEST(CudaDevice, SumOfSquaresBlocksAreBitEqual) {
  Pair p = devices();
  for (DType dtype : kDTypes) {
    const std::vector<char> in = finite_values(dtype, 21);
    DeviceBuffer c = upload(*p.cpu, *p.cs, in), g = upload(*p.gpu, *p.gs, in);
    const uint64_t blocks = kernels::sum_squares_block_count(kN);
    std::vector<double> cs(blocks), gs(blocks);
    p.cpu->sum_squares_blocks({c.data(), dtype, kN}, 0.25f, cs.data(), *p.cs);
    p.gpu->sum_squares_blocks({g.data(), dtype, kN}, 0.25f, gs.data(), *p.gs);
    ASSERT_TRUE(p.cs->synchronize().is_ok());
    ASSERT_TRUE(p.gs->synchronize().is_ok());
    for (uint64_t b = 0; b < blocks; ++b) {
      ASSERT_EQ(std::memcmp(&cs[b], &gs[b], sizeof(double)), 0)
          << dtype_name(dtype) << " block " << b << ": " << cs[b] << " vs " << gs[b];
    }
  }
}

TEST(CudaDevice, AdamIsBitEqual) {
  Pair p = devices();
  for (DType grad : kDTypes) {
    for (auto mode : {kernels::WeightDecayMode::kDecoupled, kernels::WeightDecayMode::kL2}) {
      const kernels::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f, .weight_decay_mode = mode};
      const std::vector<char> param = finite_values(DType::kF32, 31),
                              m = finite_values(DType::kF32, 32),
                              v0 = finite_values(DType::kF32, 33), g = finite_values(grad, 34);
      std::vector<char> v = v0;
      for (uint64_t i = 0; i < kN; ++i) {  // second moments are not negative
        float x;
        std::memcpy(&x, v.data() + 4 * i, 4);
        x = std::fabs(x);
        std::memcpy(v.data() + 4 * i, &x, 4);
      }
      DeviceBuffer cp = upload(*p.cpu, *p.cs, param), gp = upload(*p.gpu, *p.gs, param);
      DeviceBuffer cm = upload(*p.cpu, *p.cs, m), gm = upload(*p.gpu, *p.gs, m);
      DeviceBuffer cv = upload(*p.cpu, *p.cs, v), gv = upload(*p.gpu, *p.gs, v);
      DeviceBuffer cg = upload(*p.cpu, *p.cs, g), gg = upload(*p.gpu, *p.gs, g);
      DeviceBuffer cc = p.cpu->allocate(kN * 2, MemoryCategory::kBuffers).value();
      DeviceBuffer gc = p.gpu->allocate(kN * 2, MemoryCategory::kBuffers).value();
      for (int64_t step = 1; step <= 3; ++step) {
        const kernels::AdamStepArgs args{.step = step, .grad_scale = 0.5f};
        auto tensors = [&](DeviceBuffer& pa, DeviceBuffer& ma, DeviceBuffer& va, DeviceBuffer& ga,
                           DeviceBuffer& ca) {
          return kernels::AdamTensors{.param = static_cast<float*>(pa.data()),
                                      .m = static_cast<float*>(ma.data()),
                                      .v = static_cast<float*>(va.data()),
                                      .grad = ga.data(),
                                      .grad_dtype = grad,
                                      .param_copy = ca.data(),
                                      .copy_dtype = DType::kBF16,
                                      .n = kN};
        };
        p.cpu->adam(cfg, args, tensors(cp, cm, cv, cg, cc), *p.cs);
        p.gpu->adam(cfg, args, tensors(gp, gm, gv, gg, gc), *p.gs);
      }
      expect_same_bits(download(*p.cpu, *p.cs, cp, kN * 4), download(*p.gpu, *p.gs, gp, kN * 4),
                       DType::kF32, "adam param");
      expect_same_bits(download(*p.cpu, *p.cs, cm, kN * 4), download(*p.gpu, *p.gs, gm, kN * 4),
                       DType::kF32, "adam m");
      expect_same_bits(download(*p.cpu, *p.cs, cv, kN * 4), download(*p.gpu, *p.gs, gv, kN * 4),
                       DType::kF32, "adam v");
      expect_same_bits(download(*p.cpu, *p.cs, cc, kN * 2), download(*p.gpu, *p.gs, gc, kN * 2),
                       DType::kBF16, "adam bf16 copy");
    }
  }
}

TEST(CudaDevice, TheBudgetIsKeptAndNamed) {
  auto gpu = make_device(DeviceKind::kCuda, {.budget_bytes = 1 << 20}).value();
  auto a = gpu->allocate(768 << 10, MemoryCategory::kParameters);
  ASSERT_TRUE(a.is_ok());
  auto b = gpu->allocate(512 << 10, MemoryCategory::kGradients);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("device budget exhausted"), std::string::npos);
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  if (zinf::kernels::cuda::device_count() == 0) {
    std::puts("no CUDA device: skipping");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
