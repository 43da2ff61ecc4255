#include "zinf/io/checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace zinf::io {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// XXH3-64 of the empty input and of "abc" with seed 0: published reference values, so a
// checksum written by another XXH3 implementation (another build of zinf) verifies here.
TEST(Checksum, MatchesXxh3ReferenceValues) {
  EXPECT_EQ(detail::checksum64_portable("", 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(checksum64("", 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(checksum64("abc", 3), detail::checksum64_portable("abc", 3));
}

// The AVX2 build gives libxxhash's value for every length XXH3 treats differently (0-16, 17-128,
// 129-240, the long-input path with its stripes and 1 KiB blocks, a partial last stripe), at every
// alignment of the start, and for the swap blocks' 1 MiB and a last block shorter than that.
TEST(Checksum, Avx2BuildMatchesThePortableOneForEveryLengthAndAlignment) {
  if (!detail::checksum64_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  const auto data = random_bytes((2u << 20) + 64, 7);
  size_t compared = 0;
  for (size_t len = 0; len <= 4096; ++len) {
    for (size_t align : {0, 1, 7, 31}) {
      const unsigned char* p = data.data() + align;
      ASSERT_EQ(detail::checksum64_avx2(p, len), detail::checksum64_portable(p, len))
          << "length " << len << ", offset " << align;
      ++compared;
    }
  }
  for (size_t len : {size_t{65535}, size_t{65536}, size_t{1} << 20, (size_t{1} << 20) - 1,
                     (size_t{1} << 20) + 1, size_t{3} << 19, size_t{2} << 20}) {
    for (size_t align : {0, 1, 63}) {
      if (align + len > data.size()) continue;
      const unsigned char* p = data.data() + align;
      ASSERT_EQ(detail::checksum64_avx2(p, len), detail::checksum64_portable(p, len))
          << "length " << len << ", offset " << align;
      ++compared;
    }
  }
  EXPECT_GT(compared, 16000u);
  EXPECT_EQ(checksum64(data.data(), 1 << 20), detail::checksum64_portable(data.data(), 1 << 20));
}

// What the checksums are for: any one flipped bit of a 1 MiB block changes its hash, on the path
// this CPU takes.
TEST(Checksum, AFlippedBitChangesTheHash) {
  auto block = random_bytes(1 << 20, 11);
  const uint64_t clean = checksum64(block.data(), block.size());
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    const size_t byte = rng() % block.size();
    const unsigned char bit = static_cast<unsigned char>(1u << (rng() % 8));
    block[byte] ^= bit;
    EXPECT_NE(checksum64(block.data(), block.size()), clean) << "byte " << byte;
    block[byte] ^= bit;
  }
  EXPECT_EQ(checksum64(block.data(), block.size()), clean);
}

}  // namespace
}  // namespace zinf::io
