#include "zinf/kernels/cpu_features.h"

#include <gtest/gtest.h>

namespace zinf::kernels {
namespace {

TEST(Isa, NamesRoundTrip) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  }
  EXPECT_EQ(parse_isa("sse9"), std::nullopt);
}

TEST(Isa, BestIsSupportedAndScalarAlwaysIs) {
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(Isa::kAuto));
  EXPECT_TRUE(isa_supported(best_isa()));
  EXPECT_NE(best_isa(), Isa::kAuto);
  const CpuFeatures& f = cpu_features();
  if (isa_supported(Isa::kAvx512)) {
    EXPECT_EQ(best_isa(), Isa::kAvx512);
  }
  if (isa_supported(Isa::kAvx2)) {
    EXPECT_TRUE(f.avx2 && f.fma && f.f16c);
  }
  // The AVX-512 path runs only where the AVX2 one does too.
  if (isa_supported(Isa::kAvx512)) {
    EXPECT_TRUE(isa_supported(Isa::kAvx2));
  }
  RecordProperty("cpu", describe(f));
  RecordProperty("best_isa", std::string(isa_name(best_isa())));
}

}  // namespace
}  // namespace zinf::kernels
