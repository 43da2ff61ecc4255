#include "zinf/core/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace zinf {
namespace {

Result<int> half(int x) {
  if (x % 2) return make_error(ErrorCode::kInvalidArgument, "{} is odd", x);
  return x / 2;
}

Result<int> quarter(int x) {
  ZINF_ASSIGN_OR_RETURN(int h, half(x));
  ZINF_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

TEST(Status, ContextIsPrefixedAndCodeKept) {
  Status s = errno_status(-ENOSPC, "write of 4096 bytes at offset 8192");
  s.with_context("file /tmp/x");
  EXPECT_EQ(s.code(), ErrorCode::kNoSpace);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_EQ(s.message(), "file /tmp/x: write of 4096 bytes at offset 8192");
  EXPECT_NE(s.to_string().find("No space left on device"), std::string::npos);
}

TEST(Status, ResultPropagatesFirstError) {
  EXPECT_EQ(quarter(8).value(), 2);
  auto r = quarter(6);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "3 is odd");
  EXPECT_TRUE(Status().is_ok());
}

TEST(StatusDeathTest, CheckAbortsWithFileAndExpression) {
  EXPECT_DEATH(ZINF_CHECK(1 + 1 == 3, "math is {}", "broken"),
               "status_test.cc:.*1 \\+ 1 == 3.*math is broken");
}

}  // namespace
}  // namespace zinf
