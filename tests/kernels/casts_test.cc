// Bulk casts against the scalar conversions of zinf/core/dtype.h, bit for bit, on every path:
// every 16-bit code exhaustively, and fp32 inputs over a sweep of the whole bit space plus every
// exponent with the mantissas next to each rounding boundary.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernel_test_util.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::kernels {
namespace {

using ktest::isa_str;
using ktest::supported_isas;

std::vector<uint16_t> every_16bit_code() {
  std::vector<uint16_t> codes(65536);
  for (uint32_t c = 0; c < 65536; ++c) codes[c] = static_cast<uint16_t>(c);
  return codes;
}

// fp32 bit patterns that exercise narrowing: a sweep of the whole space, and for every sign and
// exponent the mantissas around the bf16 and fp16 rounding points (halfway, just below, just
// above, with an odd and an even kept part), the largest mantissa and the smallest.
std::vector<uint32_t> narrowing_inputs() {
  std::vector<uint32_t> in;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099) in.push_back(static_cast<uint32_t>(b));
  const uint32_t mantissas[] = {
      0x000000, 0x000001, 0x7fffff, 0x400000, 0x3fffff,
      // bf16 drops 16 bits: halfway is 0x8000
      0x007fff, 0x008000, 0x008001, 0x017fff, 0x018000, 0x018001, 0x7f8000, 0x7f7fff, 0x7fc000,
      // fp16 (normal) drops 13 bits: halfway is 0x1000
      0x000fff, 0x001000, 0x001001, 0x002fff, 0x003000, 0x003001, 0x7fefff, 0x7ff000, 0x7ff001};
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t mant : mantissas) in.push_back(sign | (exp << 23) | mant);
      // fp16 subnormal results (exponents 102..112) round at other bit positions: try every
      // halfway point of this exponent, and its neighbours.
      if (exp >= 101 && exp <= 113) {
        for (uint32_t shift = 1; shift < 24; ++shift) {
          const uint32_t half = 1u << (shift - 1);
          for (uint32_t base : {0u, 1u << shift, 3u << shift}) {
            for (int d = -1; d <= 1; ++d) {
              in.push_back(sign | (exp << 23) | ((base + half + d) & 0x7fffffu));
            }
          }
        }
      }
    }
  }
  return in;
}

TEST(Cast, WideningEvery16BitCodeMatchesScalar) {
  const std::vector<uint16_t> codes = every_16bit_code();
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (Isa isa : supported_isas()) {
      for (size_t offset : {0, 1}) {  // also from an odd address
        std::vector<float> out(codes.size() - offset);
        cast(codes.data() + offset, d, out.data(), DType::kF32, out.size(), 2, isa);
        for (size_t i = 0; i < out.size(); ++i) {
          const uint16_t c = codes[i + offset];
          const float want = d == DType::kBF16 ? bf16_to_f32(c) : f16_to_f32(c);
          ASSERT_EQ(f32_bits(out[i]), f32_bits(want))
              << isa_str(isa) << " " << dtype_name(d) << " code " << std::hex << c;
        }
      }
    }
  }
}

TEST(Cast, NarrowingMatchesScalarBitForBit) {
  const std::vector<uint32_t> bits = narrowing_inputs();
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> want(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      want[i] = d == DType::kBF16 ? f32_to_bf16(in[i]) : f32_to_f16(in[i]);
    }
    for (Isa isa : supported_isas()) {
      std::vector<uint16_t> out(in.size());
      cast(in.data(), DType::kF32, out.data(), d, in.size(), 0, isa);
      size_t bad = 0;
      for (size_t i = 0; i < in.size() && bad < 5; ++i) {
        if (out[i] != want[i]) {
          ++bad;
          ADD_FAILURE() << isa_str(isa) << " " << dtype_name(d) << " input " << std::hex << bits[i]
                        << " gave " << out[i] << ", scalar " << want[i];
        }
      }
    }
  }
}

TEST(Cast, Bf16AndF16ConvertThroughF32WithOneRounding) {
  const std::vector<uint16_t> codes = every_16bit_code();
  for (Isa isa : supported_isas()) {
    std::vector<uint16_t> to_f16(codes.size()), to_bf16(codes.size());
    cast(codes.data(), DType::kBF16, to_f16.data(), DType::kF16, codes.size(), 1, isa);
    cast(codes.data(), DType::kF16, to_bf16.data(), DType::kBF16, codes.size(), 1, isa);
    for (size_t i = 0; i < codes.size(); ++i) {
      ASSERT_EQ(to_f16[i], f32_to_f16(bf16_to_f32(codes[i]))) << isa_str(isa) << " " << i;
      ASSERT_EQ(to_bf16[i], f32_to_bf16(f16_to_f32(codes[i]))) << isa_str(isa) << " " << i;
    }
  }
}

TEST(Cast, SameDtypeIsACopyThatKeepsSignallingNans) {
  const std::vector<uint16_t> codes = every_16bit_code();
  std::vector<uint16_t> out(codes.size());
  cast(codes.data(), DType::kBF16, out.data(), DType::kBF16, codes.size());
  EXPECT_EQ(out, codes);
  const std::vector<float> f = {1.0f, -0.0f, bits_f32(0x7f800001u)};  // a signalling NaN
  std::vector<float> g(f.size());
  cast(f.data(), DType::kF32, g.data(), DType::kF32, f.size());
  EXPECT_EQ(std::memcmp(f.data(), g.data(), f.size() * 4), 0);
}

TEST(Cast, LargeMultithreadedCastEqualsSingleThreaded) {
  const size_t n = 4 * kCpuChunkElems + 999;
  std::vector<float> in(n);
  for (size_t i = 0; i < n; ++i) in[i] = bits_f32(static_cast<uint32_t>(i * 2654435761u));
  for (Isa isa : supported_isas()) {
    std::vector<uint16_t> one(n), many(n);
    cast(in.data(), DType::kF32, one.data(), DType::kF16, n, 1, isa);
    cast(in.data(), DType::kF32, many.data(), DType::kF16, n, 4, isa);
    EXPECT_EQ(one, many) << isa_str(isa);
  }
  cast(nullptr, DType::kF32, nullptr, DType::kBF16, 0);
}

}  // namespace
}  // namespace zinf::kernels
