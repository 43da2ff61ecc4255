// The device's operations, element by element against the CPU kernels and a scalar reference,
// on the plain and the strict CPU device (the same checks run on any backend that implements
// the contract). And the strict device itself: host code that touches its memory faults.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/device.h"

namespace zinf {
namespace {

class DeviceOps : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    device_ = make_cpu_device({.budget_bytes = 64 << 20, .strict = GetParam()});
    stream_ = device_->create_stream("test");
  }

  // A device buffer holding `host`'s bytes.
  template <typename T>
  DeviceBuffer upload(const std::vector<T>& host) {
    DeviceBuffer b = device_->allocate(host.size() * sizeof(T), MemoryCategory::kBuffers).value();
    device_->copy_async(b.data(), host.data(), host.size() * sizeof(T), *stream_);
    EXPECT_TRUE(stream_->synchronize().is_ok());
    return b;
  }
  template <typename T>
  std::vector<T> download(const DeviceBuffer& b, size_t n) {
    std::vector<T> host(n);
    device_->copy_async(host.data(), b.data(), n * sizeof(T), *stream_);
    EXPECT_TRUE(stream_->synchronize().is_ok());
    return host;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

// Values that exercise rounding, subnormals (fp16), signed zeros and large magnitudes.
std::vector<float> values(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const float unit = static_cast<float>(x >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
    v[i] = unit * std::ldexp(1.0f, static_cast<int>(i % 37) - 24);
  }
  if (n > 3) {
    v[0] = -0.0f;
    v[1] = 0.0f;
    v[2] = 1.0f + std::ldexp(1.0f, -8);  // a bf16 tie
  }
  return v;
}

// Host bytes of `v` converted to `dtype` by the scalar conversions of dtype.h.
std::vector<uint8_t> encode(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
float decode(const uint8_t* p, DType dtype, size_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr size_t kN = 70'001;  // several kernel chunks and a ragged tail

TEST_P(DeviceOps, FillWritesTheValueInEveryDtype) {
  for (DType dt : kDTypes) {
    for (float value : {0.0f, -0.0f, 1.5f, 3.0e-5f}) {
      DeviceBuffer b = device_->allocate(kN * 4, MemoryCategory::kBuffers).value();
      device_->fill({.data = b.data(), .dtype = dt, .numel = kN}, value, *stream_);
      auto host = download<uint8_t>(b, kN * dtype_size(dt));
      const auto expect = encode({value}, dt);
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_EQ(std::memcmp(host.data() + i * dtype_size(dt), expect.data(), dtype_size(dt)), 0)
            << dtype_name(dt) << " value " << value << " element " << i;
      }
    }
  }
}

TEST_P(DeviceOps, CastMatchesTheScalarConversions) {
  const std::vector<float> v = values(kN, 1);
  for (DType from : kDTypes) {
    const auto src_host = encode(v, from);
    DeviceBuffer src = upload(src_host);
    for (DType to : kDTypes) {
      DeviceBuffer dst = device_->allocate(kN * 4, MemoryCategory::kBuffers).value();
      device_->cast({.data = dst.data(), .dtype = to, .numel = kN}, {src.data(), from, kN},
                    *stream_);
      auto got = download<uint8_t>(dst, kN * dtype_size(to));
      std::vector<float> mid(kN);
      for (size_t i = 0; i < kN; ++i) mid[i] = decode(src_host.data(), from, i);
      const auto expect = encode(mid, to);
      ASSERT_EQ(got, expect) << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

TEST_P(DeviceOps, CastReachesHostMemoryOnEitherSide) {
  const std::vector<float> v = values(kN, 2);
  DeviceBuffer dev = device_->allocate(kN * 2, MemoryCategory::kBuffers).value();
  device_->cast({.data = dev.data(), .dtype = DType::kBF16, .numel = kN},
                {v.data(), DType::kF32, kN}, *stream_);  // host -> device, converting
  std::vector<float> back(kN);
  device_->cast({.data = back.data(), .dtype = DType::kF32, .numel = kN},
                {dev.data(), DType::kBF16, kN}, *stream_);  // device -> host, converting
  ASSERT_TRUE(stream_->synchronize().is_ok());
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(f32_bits(back[i]), f32_bits(bf16_to_f32(f32_to_bf16(v[i])))) << i;
  }
}

TEST_P(DeviceOps, AccumulateAddsInFp32WithConversion) {
  const std::vector<float> base = values(kN, 3);
  for (DType dt : kDTypes) {
    const auto src_host = encode(values(kN, 4), dt);
    DeviceBuffer src = upload(src_host);
    for (bool overwrite : {false, true}) {
      DeviceBuffer acc = upload(base);
      device_->accumulate({.data = acc.data(), .dtype = DType::kF32, .numel = kN},
                          {src.data(), dt, kN}, overwrite, *stream_);
      auto got = download<float>(acc, kN);
      for (size_t i = 0; i < kN; ++i) {
        const float x = decode(src_host.data(), dt, i);
        const float expect = overwrite ? 0.0f + x : base[i] + x;
        ASSERT_EQ(f32_bits(got[i]), f32_bits(expect))
            << dtype_name(dt) << (overwrite ? " overwrite" : " add") << " element " << i;
      }
    }
  }
}

TEST_P(DeviceOps, ScaleSetsTheNonFiniteFlag) {
  for (DType dt : kDTypes) {
    std::vector<float> v = values(kN, 5);
    const auto host = encode(v, dt);
    DeviceBuffer x = upload(host);
    bool nonfinite = true;
    device_->scale({.data = x.data(), .dtype = dt, .numel = kN}, 0.25f, &nonfinite, *stream_);
    auto got = download<uint8_t>(x, kN * dtype_size(dt));
    EXPECT_FALSE(nonfinite) << dtype_name(dt);
    std::vector<float> scaled(kN);
    for (size_t i = 0; i < kN; ++i) scaled[i] = decode(host.data(), dt, i) * 0.25f;
    ASSERT_EQ(got, encode(scaled, dt)) << dtype_name(dt);

    v[kN - 7] = std::numeric_limits<float>::infinity();
    DeviceBuffer y = upload(encode(v, dt));
    device_->scale({.data = y.data(), .dtype = dt, .numel = kN}, 0.5f, &nonfinite, *stream_);
    ASSERT_TRUE(stream_->synchronize().is_ok());
    EXPECT_TRUE(nonfinite) << dtype_name(dt);
  }
}

TEST_P(DeviceOps, SumOfSquaresBlocksAreTheKernelsAndCloseToDouble) {
  for (DType dt : kDTypes) {
    const auto host = encode(values(kN, 6), dt);
    DeviceBuffer x = upload(host);
    std::vector<double> got(kernels::sum_squares_block_count(kN));
    device_->sum_squares_blocks({x.data(), dt, kN}, 0.5f, got.data(), *stream_);
    ASSERT_TRUE(stream_->synchronize().is_ok());
    std::vector<double> kernel(got.size());
    kernels::grad_sum_squares_blocks(host.data(), dt, kN, 0.5f, kernel.data());
    for (size_t b = 0; b < got.size(); ++b) {
      ASSERT_EQ(got[b], kernel[b]) << dtype_name(dt) << " block " << b;  // bit for bit
      double ref = 0;
      const size_t end = std::min(kN, (b + 1) * kernels::kSumSquaresBlockElems);
      for (size_t i = b * kernels::kSumSquaresBlockElems; i < end; ++i) {
        const double e = static_cast<double>(decode(host.data(), dt, i)) * 0.5;
        ref += e * e;
      }
      ASSERT_NEAR(got[b], ref, 1e-12 * ref) << dtype_name(dt) << " block " << b;
    }
  }
}

TEST_P(DeviceOps, AdamIsTheCpuKernelBitForBit) {
  const kernels::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  const kernels::AdamStepArgs args{.step = 3, .grad_scale = 0.5f};
  for (DType grad_dtype : kDTypes) {
    const std::vector<float> p = values(kN, 7), m = values(kN, 8);
    std::vector<float> v = values(kN, 9);
    for (float& x : v) x = std::fabs(x);
    const auto g = encode(values(kN, 10), grad_dtype);
    DeviceBuffer dp = upload(p), dm = upload(m), dv = upload(v), dg = upload(g);
    DeviceBuffer copy = device_->allocate(kN * 2, MemoryCategory::kBuffers).value();
    device_->adam(cfg, args,
                  {.param = static_cast<float*>(dp.data()),
                   .m = static_cast<float*>(dm.data()),
                   .v = static_cast<float*>(dv.data()),
                   .grad = dg.data(),
                   .grad_dtype = grad_dtype,
                   .param_copy = copy.data(),
                   .copy_dtype = DType::kBF16,
                   .n = kN},
                  *stream_);
    std::vector<float> hp = p, hm = m, hv = v;
    std::vector<uint16_t> hcopy(kN);
    kernels::adam_step(cfg, args,
                       {.param = hp.data(),
                        .m = hm.data(),
                        .v = hv.data(),
                        .grad = g.data(),
                        .grad_dtype = grad_dtype,
                        .param_copy = hcopy.data(),
                        .copy_dtype = DType::kBF16,
                        .n = kN});
    EXPECT_EQ(download<float>(dp, kN), hp) << dtype_name(grad_dtype);
    EXPECT_EQ(download<float>(dm, kN), hm) << dtype_name(grad_dtype);
    EXPECT_EQ(download<float>(dv, kN), hv) << dtype_name(grad_dtype);
    EXPECT_EQ(download<uint16_t>(copy, kN), hcopy) << dtype_name(grad_dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(CpuDevice, DeviceOps, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "strict" : "plain"; });

// The check that makes the strict device worth having: it can fail.
TEST(StrictCpuDeviceDeathTest, HostReadOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto device = make_cpu_device({.budget_bytes = 1 << 20, .strict = true});
  DeviceBuffer b = device->allocate(4096, MemoryCategory::kBuffers).value();
  volatile const char* p = static_cast<const char*>(b.data());
  EXPECT_DEATH({ (void)p[100]; }, "");
}

TEST(StrictCpuDeviceDeathTest, HostWriteOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto device = make_cpu_device({.budget_bytes = 1 << 20, .strict = true});
  DeviceBuffer b = device->allocate(4096, MemoryCategory::kBuffers).value();
  EXPECT_DEATH({ std::memset(b.data(), 1, 16); }, "");
}

// A comm window on the strict device is a host copy, as on CUDA: what the collective reads is
// copied in, what it writes is copied back on close(), and the device's memory stays unreachable
// all along (a caller that used the device address would fault).
TEST(StrictCpuDevice, CommWindowsAreStagedCopiesWrittenBackOnClose) {
  auto device = make_cpu_device({.budget_bytes = 1 << 20, .strict = true});
  auto stream = device->create_stream("s");
  DeviceBuffer b = device->allocate(8192, MemoryCategory::kBuffers).value();
  device->fill({b.data(), DType::kF32, 2048}, 1.5f, *stream);
  ASSERT_TRUE(stream->synchronize().is_ok());
  auto read_back = [&] {
    std::vector<float> host(2048);
    device->copy_async(host.data(), b.data(), 8192, *stream);
    EXPECT_TRUE(stream->synchronize().is_ok());
    return host;
  };
  {
    Device::CommWindow in = device->comm_window(b.data(), 8192, Device::WindowAccess::kRead);
    ASSERT_NE(in.data(), b.data());
    auto* f = static_cast<float*>(in.data());
    EXPECT_EQ(f[2047], 1.5f);  // copied in
    f[0] = 9.0f;               // a read-only window is not written back
    EXPECT_TRUE(in.close().is_ok());
  }
  EXPECT_EQ(read_back()[0], 1.5f);
  {
    Device::CommWindow out = device->comm_window(b.data(), 8192, Device::WindowAccess::kWrite);
    auto* f = static_cast<float*>(out.data());
    EXPECT_TRUE(std::isnan(f[3])) << "a write-only window starts as NaN, not as the range";
    for (int i = 0; i < 2048; ++i) f[i] = static_cast<float>(i);
    volatile const char* p = static_cast<const char*>(b.data());
    EXPECT_DEATH({ (void)p[0]; }, "") << "the device's memory stays unreachable";
    EXPECT_TRUE(out.close().is_ok());
    EXPECT_EQ(out.data(), nullptr);
  }
  const auto written = read_back();
  EXPECT_EQ(written[0], 0.0f);
  EXPECT_EQ(written[2047], 2047.0f);
  {
    Device::CommWindow both = device->comm_window(b.data(), 8192, Device::WindowAccess::kReadWrite);
    auto* f = static_cast<float*>(both.data());
    EXPECT_EQ(f[7], 7.0f);
    f[7] += 0.5f;
  }  // closed by its destructor: written back too
  EXPECT_EQ(read_back()[7], 7.5f);
}

// The plain device's memory is host memory: a comm window is the range itself.
TEST(CpuDevice, CommWindowIsTheRangeItself) {
  auto device = make_cpu_device({.budget_bytes = 1 << 20});
  DeviceBuffer b = device->allocate(4096, MemoryCategory::kBuffers).value();
  Device::CommWindow w = device->comm_window(b.data(), 4096, Device::WindowAccess::kReadWrite);
  EXPECT_EQ(w.data(), b.data());
  EXPECT_TRUE(w.close().is_ok());
}

// A model computing on the host reaches device memory through host_window: open while it lives
// (on the strict device too), unreachable once it closes.
TEST(StrictCpuDevice, HostWindowLendsTheRangeInPlaceUntilClosed) {
  auto device = make_cpu_device({.budget_bytes = 1 << 20, .strict = true});
  auto stream = device->create_stream("s");
  DeviceBuffer b = device->allocate(8192, MemoryCategory::kBuffers).value();
  device->fill({b.data(), DType::kF32, 2048}, 1.5f, *stream);
  ASSERT_TRUE(stream->synchronize().is_ok());
  {
    std::optional<Device::CommWindow> w = device->host_window(b.data(), 8192);
    ASSERT_TRUE(w.has_value()) << "the CPU device's memory is host memory";
    auto* f = static_cast<float*>(b.data());
    EXPECT_EQ(f[2047], 1.5f);  // the device's write, read in place
    f[5] = -2.0f;              // the model's write, seen by the device below
  }
  std::vector<float> host(2048);
  device->copy_async(host.data(), b.data(), 8192, *stream);
  ASSERT_TRUE(stream->synchronize().is_ok());
  EXPECT_EQ(host[5], -2.0f);
  EXPECT_EQ(host[6], 1.5f);
  volatile const char* p = static_cast<const char*>(b.data());
  EXPECT_DEATH({ (void)p[0]; }, "") << "the window closed: the memory is unreachable again";
}

TEST(StrictCpuDevice, ReusedBlocksStayUnreachable) {
  auto device = make_cpu_device({.budget_bytes = 1 << 20, .strict = true});
  void* first = nullptr;
  {
    DeviceBuffer b = device->allocate(4096, MemoryCategory::kBuffers).value();
    first = b.data();
  }
  DeviceBuffer again = device->allocate(4096, MemoryCategory::kBuffers).value();
  EXPECT_EQ(again.data(), first);  // from the cache
  volatile const char* p = static_cast<const char*>(again.data());
  EXPECT_DEATH({ (void)p[0]; }, "");
}

TEST(DeviceKind, ResolvesFromTheEnvironment) {
  EXPECT_EQ(parse_device_kind("cpu-strict"), DeviceKind::kCpuStrict);
  EXPECT_EQ(parse_device_kind("gpu"), std::nullopt);
  EXPECT_EQ(resolve_device_kind(DeviceKind::kCpuStrict).value(), DeviceKind::kCpuStrict);
}

}  // namespace
}  // namespace zinf
