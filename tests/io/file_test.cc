// File and DirHandle: exclusive creation, the O_DIRECT fallback without an orphan, no symlink
// followed, and no file left behind by a failed open.
#include "zinf/io/file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>

#include "test_dir.h"
#include "zinf/io/fault.h"

namespace zinf::io {
namespace {

namespace fs = std::filesystem;

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FaultInjector::global().clear();
    ASSERT_FALSE(dir_.path().empty());
    auto d = DirHandle::open(dir_.path());
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    handle_ = std::move(*d);
  }
  void TearDown() override { FaultInjector::global().clear(); }

  std::set<std::string> entries() const {
    std::set<std::string> names;
    for (auto& e : fs::directory_iterator(dir_.path())) names.insert(e.path().filename());
    return names;
  }

  testing::TempDir dir_;
  DirHandle handle_;
};

TEST_F(FileTest, OpenAtCreatesInTheDirectoryWithMode0600) {
  auto f = File::open_at(handle_, "a.bin", {.create = true, .exclusive = true});
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->path(), dir_.file("a.bin"));
  EXPECT_TRUE(f->direct());
  struct stat st {};
  ASSERT_EQ(::stat(dir_.file("a.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(entries(), std::set<std::string>{"a.bin"});
}

// A file system that creates the file before refusing O_DIRECT: the file stays open buffered,
// O_EXCL is kept (a second exclusive open fails with EEXIST) and nothing else is created. The
// failed second open does not remove the file the first one made.
TEST_F(FileTest, DirectRefusedAfterCreationFallsBackWithoutAnOrphan) {
  FaultInjector::global().set_refuse_direct(true);
  auto f = File::open_at(handle_, "swap-0.bin", {.create = true, .exclusive = true});
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_FALSE(f->direct());
  EXPECT_EQ(f->offset_alignment(), 1u);
  EXPECT_EQ(entries(), std::set<std::string>{"swap-0.bin"});

  auto again = File::open_at(handle_, "swap-0.bin", {.create = true, .exclusive = true});
  ASSERT_FALSE(again.is_ok());
  EXPECT_EQ(again.status().sys_errno(), EEXIST);
  EXPECT_NE(again.status().message().find(dir_.file("swap-0.bin")), std::string::npos);
  EXPECT_EQ(entries(), std::set<std::string>{"swap-0.bin"});
  // The plain-path flavour behaves the same.
  auto plain = File::open(dir_.file("b.bin"), {.create = true, .exclusive = true});
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  EXPECT_FALSE(plain->direct());
  EXPECT_EQ(entries(), (std::set<std::string>{"b.bin", "swap-0.bin"}));
}

// A planted symlink is never followed: not to create, not to open an existing target.
TEST_F(FileTest, SymlinksAreRefused) {
  const std::string target = dir_.file("target");
  ASSERT_EQ(::symlink(target.c_str(), dir_.file("link").c_str()), 0);
  for (bool exclusive : {false, true}) {
    auto f = File::open_at(handle_, "link", {.create = true, .exclusive = exclusive});
    EXPECT_FALSE(f.is_ok()) << "exclusive " << exclusive;
  }
  EXPECT_FALSE(fs::exists(target));
  ::close(::open(target.c_str(), O_CREAT | O_WRONLY, 0600));
  EXPECT_FALSE(File::open_at(handle_, "link", {}).is_ok());
  EXPECT_FALSE(File::open(dir_.file("link"), {}).is_ok());
  EXPECT_FALSE(DirHandle::open_at(handle_, "link").is_ok());
  // Names, not paths: open_at cannot be steered out of its directory.
  for (const char* bad : {"../x", "a/b", "..", ""}) {
    auto f = File::open_at(handle_, bad, {.create = true});
    ASSERT_FALSE(f.is_ok()) << bad;
    EXPECT_EQ(f.status().code(), ErrorCode::kInvalidArgument) << bad;
  }
}

// Without O_EXCL an existing file is opened as it is, and a failed open of it leaves it alone.
TEST_F(FileTest, NonExclusiveCreateOpensAnExistingFile) {
  ::close(::open(dir_.file("old.bin").c_str(), O_CREAT | O_WRONLY, 0600));
  auto f = File::open_at(handle_, "old.bin", {.create = true});
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  auto ro = File::open_at(handle_, "missing.bin", {.read_only = true});
  ASSERT_FALSE(ro.is_ok());
  EXPECT_EQ(ro.status().sys_errno(), ENOENT);
  EXPECT_EQ(entries(), std::set<std::string>{"old.bin"});
}

}  // namespace
}  // namespace zinf::io
