#include "zinf/core/units.h"

#include <gtest/gtest.h>

namespace zinf {
namespace {

TEST(Units, ParsesSuffixes) {
  EXPECT_EQ(parse_bytes("4096").value(), 4096u);
  EXPECT_EQ(parse_bytes("128K").value(), 128u << 10);
  EXPECT_EQ(parse_bytes("1m").value(), 1u << 20);
  EXPECT_EQ(parse_bytes("4G").value(), 4ull << 30);
  EXPECT_EQ(parse_bytes("1.5GiB").value(), 3ull << 29);
  EXPECT_EQ(parse_bytes("2MB").value(), 2u << 20);
}

TEST(Units, RejectsBadInputWithMessage) {
  for (const char* bad : {"", "abc", "1X", "0.3", "1..2M"}) {
    auto r = parse_bytes(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
  }
}

TEST(Units, Alignment) {
  EXPECT_EQ(align_up(1, 4096), 4096u);
  EXPECT_EQ(align_up(4096, 4096), 4096u);
  EXPECT_EQ(align_down(8191, 4096), 4096u);
}

}  // namespace
}  // namespace zinf
