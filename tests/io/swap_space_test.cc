#include "zinf/io/swap_space.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <future>
#include <random>

#include "test_dir.h"
#include "zinf/io/aligned_buffer.h"
#include "zinf/io/fault.h"

namespace zinf::io {
namespace {

namespace fs = std::filesystem;

class SwapSpaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FaultInjector::global().clear();
    auto e = IoEngine::create({.queue_depth = 16, .block_size = 256 << 10});
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(e).value();
  }
  void TearDown() override { FaultInjector::global().clear(); }

  std::unique_ptr<SwapSpace> make(SwapSpaceOptions o) {
    auto s = SwapSpace::create(*engine_, std::move(o));
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  static AlignedBuffer random_buffer(size_t bytes, uint64_t seed) {
    AlignedBuffer b(bytes);
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < bytes / 8; ++i) reinterpret_cast<uint64_t*>(b.data())[i] = rng();
    return b;
  }
  static size_t count_files(const std::string& dir) {
    size_t n = 0;
    for (auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file();
    return n;
  }

  testing::TempDir a_, b_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(SwapSpaceTest, StripedRoundTripsAndCleansUp) {
  std::vector<std::string> run_dirs;
  {
    auto swap = make({.directories = {a_.path(), b_.path()},
                      .file_bytes = 8 << 20,
                      .stripe_min_bytes = 64 << 10,
                      .checksum = true});
    ASSERT_TRUE(swap);
    run_dirs = swap->run_directories();
    ASSERT_EQ(run_dirs.size(), 2u);
    struct stat st {};
    ASSERT_EQ(::stat(run_dirs[0].c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);

    std::vector<ExtentId> ids;
    std::vector<AlignedBuffer> data;
    for (int i = 0; i < 12; ++i) {
      uint64_t bytes = 1000 + i * 300000;  // rounded up to 4 KiB; the big ones are striped
      auto id = swap->allocate(bytes, "tensor" + std::to_string(i));
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      EXPECT_EQ(swap->padded_bytes(*id), (bytes + 4095) / 4096 * 4096);
      data.push_back(random_buffer(swap->padded_bytes(*id), i));
      ASSERT_TRUE(swap->write(*id, data.back().data()).is_ok());
      ids.push_back(*id);
    }
    // Both directories hold data (striping), in 0600 files.
    EXPECT_GE(count_files(run_dirs[0]), 1u);
    EXPECT_GE(count_files(run_dirs[1]), 1u);
    for (auto& e : fs::directory_iterator(run_dirs[0])) {
      ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      AlignedBuffer back(swap->padded_bytes(ids[i]));
      ASSERT_TRUE(swap->read(ids[i], back.data()).is_ok());
      ASSERT_EQ(std::memcmp(back.data(), data[i].data(), back.size()), 0) << "extent " << i;
    }
    SwapStats s = swap->stats();
    EXPECT_EQ(s.extents, 12u);
    for (auto id : ids) ASSERT_TRUE(swap->free(id).is_ok());
    EXPECT_EQ(swap->stats().bytes_allocated, 0u);
    EXPECT_EQ(swap->free(ids[0]).code(), ErrorCode::kNotFound);
  }
  // Clean shutdown removes the run directories and their files.
  EXPECT_FALSE(fs::exists(run_dirs[0]));
  EXPECT_FALSE(fs::exists(run_dirs[1]));
}

TEST_F(SwapSpaceTest, FreedSpaceIsReusedWithoutGrowing) {
  auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20});
  ASSERT_TRUE(swap);
  std::vector<ExtentId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*swap->allocate(256 << 10));
  EXPECT_EQ(swap->stats().files, 1u);
  ASSERT_TRUE(swap->free(ids[1]).is_ok());
  ASSERT_TRUE(swap->free(ids[2]).is_ok());
  // Two freed neighbours coalesce into one hole that fits 512 KiB.
  auto big = swap->allocate(512 << 10);
  ASSERT_TRUE(big.is_ok());
  EXPECT_EQ(swap->stats().files, 1u);
  EXPECT_EQ(swap->stats().bytes_reserved, 1u << 20);
}

TEST_F(SwapSpaceTest, ChecksumCatchesCorruptionOnDisk) {
  auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20, .checksum = true});
  ASSERT_TRUE(swap);
  auto id = swap->allocate(64 << 10, "blocks.0.params");
  ASSERT_TRUE(id.is_ok());
  AlignedBuffer data = random_buffer(64 << 10, 5);
  ASSERT_TRUE(swap->write(*id, data.data()).is_ok());
  // Flip one byte behind the engine's back.
  std::string file;
  for (auto& e : fs::directory_iterator(swap->run_directories()[0])) file = e.path();
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c;
  ASSERT_EQ(::pread(fd, &c, 1, 1234), 1);
  c ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &c, 1, 1234), 1);
  ::close(fd);
  AlignedBuffer back(64 << 10);
  Status s = swap->read(*id, back.data());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), ErrorCode::kCorrupt);
  EXPECT_NE(s.message().find("blocks.0.params"), std::string::npos) << s.message();
}

// Every read path checks the blocks: the callback's (on the I/O thread) and one left to the
// waiter (ReadCheck, which the store and the synchronous reads use so that the ring's thread does
// not hash): the I/O itself succeeds, verify() finds the flipped byte's block.
TEST_F(SwapSpaceTest, AChecksumLeftToTheWaiterCatchesTheSameCorruption) {
  auto swap = make({.directories = {a_.path()}, .file_bytes = 4 << 20, .checksum = true});
  ASSERT_TRUE(swap);
  const uint64_t mib = 1 << 20;
  auto id = swap->allocate(2 * mib, "blocks.1.adam_m");
  ASSERT_TRUE(id.is_ok());
  AlignedBuffer data = random_buffer(2 * mib, 6);
  ASSERT_TRUE(swap->write(*id, data.data()).is_ok());
  auto read_checked = [&](uint64_t offset, uint64_t length, AlignedBuffer& into, Status& io) {
    std::promise<Status> p;
    ReadCheck check;
    EXPECT_TRUE(swap->read_range_async(
                        *id, offset, length, into.data(),
                        [&p](Status st) { p.set_value(std::move(st)); }, check)
                    .is_ok());
    EXPECT_TRUE(static_cast<bool>(check)) << "checksums on: the check is the caller's";
    io = p.get_future().get();
    return swap->verify(check);
  };
  AlignedBuffer back(2 * mib);
  Status io;
  EXPECT_TRUE(read_checked(0, 2 * mib, back, io).is_ok());
  EXPECT_TRUE(io.is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 2 * mib), 0);
  // Flip one byte of the second block behind the engine's back.
  std::string file;
  for (auto& e : fs::directory_iterator(swap->run_directories()[0])) file = e.path();
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c;
  ASSERT_EQ(::pread(fd, &c, 1, mib + 77), 1);
  c ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &c, 1, mib + 77), 1);
  ::close(fd);
  Status bad = read_checked(0, 2 * mib, back, io);
  EXPECT_TRUE(io.is_ok()) << "the read itself succeeded";
  EXPECT_EQ(bad.code(), ErrorCode::kCorrupt);
  EXPECT_NE(bad.message().find("blocks.1.adam_m"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("offset 1048576"), std::string::npos) << bad.message();
  EXPECT_TRUE(read_checked(0, mib, back, io).is_ok()) << "the first block is intact";
  // The synchronous read and the callback's check find it too.
  EXPECT_EQ(swap->read(*id, back.data()).code(), ErrorCode::kCorrupt);
  std::promise<Status> p;
  ASSERT_TRUE(
      swap->read_async(*id, back.data(), [&p](Status st) { p.set_value(std::move(st)); }).is_ok());
  EXPECT_EQ(p.get_future().get().code(), ErrorCode::kCorrupt);
  // With checksums off there is nothing to check.
  auto plain = make({.directories = {b_.path()}, .file_bytes = 1 << 20, .checksum = false});
  ASSERT_TRUE(plain);
  auto pid = plain->allocate(mib);
  ASSERT_TRUE(pid.is_ok());
  ASSERT_TRUE(plain->write(*pid, data.data()).is_ok());
  ReadCheck none;
  std::promise<Status> q;
  ASSERT_TRUE(
      plain
          ->read_range_async(
              *pid, 0, mib, back.data(), [&q](Status st) { q.set_value(std::move(st)); }, none)
          .is_ok());
  EXPECT_TRUE(q.get_future().get().is_ok());
  EXPECT_FALSE(static_cast<bool>(none));
  EXPECT_TRUE(plain->verify(none).is_ok());
}

TEST_F(SwapSpaceTest, FullDiskIsAClearErrorAndLeavesNothingBehind) {
  auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20});
  ASSERT_TRUE(swap);
  FaultInjector::global().set_fallocate_enospc(true);
  auto id = swap->allocate(4096, "embedding.params");
  ASSERT_FALSE(id.is_ok());
  EXPECT_EQ(id.status().code(), ErrorCode::kNoSpace);
  EXPECT_NE(id.status().message().find("embedding.params"), std::string::npos);
  EXPECT_NE(id.status().message().find(a_.path()), std::string::npos);
  EXPECT_EQ(count_files(swap->run_directories()[0]), 0u);
  FaultInjector::global().set_fallocate_enospc(false);
  EXPECT_TRUE(swap->allocate(4096).is_ok());
}

TEST_F(SwapSpaceTest, WriteErrorNamesExtentAndKeepsOldChecksumFromBeingTrusted) {
  auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20, .checksum = true});
  ASSERT_TRUE(swap);
  auto id = swap->allocate(8192, "m.shard3");
  AlignedBuffer data = random_buffer(8192, 1);
  FaultInjector::global().add({.op = IoOp::kWrite, .nth = 1, .kind = FaultKind::kEio});
  Status s = swap->write(*id, data.data());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("m.shard3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("swap-0.bin"), std::string::npos) << s.message();
  // The failed write leaves the extent "never written": reading it is refused, not trusted.
  AlignedBuffer back(8192);
  EXPECT_EQ(swap->read(*id, back.data()).code(), ErrorCode::kInvalidArgument);
}

TEST_F(SwapSpaceTest, RangesReadAndWritePartsWithBlockChecksums) {
  auto swap = make({.directories = {a_.path(), b_.path()},
                    .file_bytes = 4 << 20,
                    .stripe_min_bytes = 256 << 10,
                    .checksum = true});
  ASSERT_TRUE(swap);
  const uint64_t mib = 1 << 20;
  auto id = swap->allocate(3 * mib + 8192, "fp32.master");  // striped, partial last block
  ASSERT_TRUE(id.is_ok());
  uint64_t padded = swap->padded_bytes(*id);
  AlignedBuffer whole = random_buffer(padded, 21);
  ASSERT_TRUE(swap->write(*id, whole.data()).is_ok());
  AlignedBuffer part(mib);
  ASSERT_TRUE(swap->read_range(*id, mib, mib, part.data()).is_ok());
  EXPECT_EQ(std::memcmp(part.data(), whole.data() + mib, mib), 0);
  // Overwrite the second-to-last block and the partial tail, then read everything back.
  AlignedBuffer fresh = random_buffer(padded - 2 * mib, 22);
  ASSERT_TRUE(swap->write_range(*id, 2 * mib, padded - 2 * mib, fresh.data()).is_ok());
  std::memcpy(whole.data() + 2 * mib, fresh.data(), padded - 2 * mib);
  AlignedBuffer back(padded);
  ASSERT_TRUE(swap->read(*id, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), whole.data(), padded), 0);
  // With checksums, ranges must cover whole blocks; and ranges must lie inside the extent.
  EXPECT_EQ(swap->read_range(*id, 4096, mib, part.data()).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(swap->read_range(*id, 3 * mib, 2 * mib, part.data()).code(),
            ErrorCode::kInvalidArgument);
}

// The run directory is 0700 and the swap files 0600 whatever the umask lets through.
TEST_F(SwapSpaceTest, RunDirectoryAndFilesArePrivateUnderAnyUmask) {
  const mode_t old = ::umask(0);
  auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20});
  ::umask(old);
  ASSERT_TRUE(swap);
  ASSERT_TRUE(swap->allocate(4096, "x").is_ok());
  const std::string run = swap->run_directories()[0];
  EXPECT_EQ(fs::path(run).parent_path(), fs::path(a_.path()));
  struct stat st {};
  ASSERT_EQ(::lstat(run.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  size_t files = 0;
  for (auto& e : fs::directory_iterator(run)) {
    ASSERT_EQ(::lstat(e.path().c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode)) << e.path();
    EXPECT_EQ(st.st_mode & 07777, 0600u) << e.path();
    ++files;
  }
  EXPECT_EQ(files, 1u);
}

// A file system that creates the file and then refuses O_DIRECT: the swap space runs buffered,
// with exactly the files it made, and removes them all at the end.
TEST_F(SwapSpaceTest, DirectRefusalRunsBufferedWithoutOrphans) {
  FaultInjector::global().set_refuse_direct(true);
  std::string run;
  {
    auto swap = make({.directories = {a_.path()}, .file_bytes = 1 << 20, .checksum = true});
    ASSERT_TRUE(swap);
    run = swap->run_directories()[0];
    std::vector<ExtentId> ids;
    for (int i = 0; i < 3; ++i) {  // three files of 1 MiB
      auto id = swap->allocate(1 << 20, "t" + std::to_string(i));
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      ids.push_back(*id);
    }
    EXPECT_EQ(count_files(run), 3u);
    AlignedBuffer data = random_buffer(1 << 20, 3), back(1 << 20);
    ASSERT_TRUE(swap->write(ids[2], data.data()).is_ok());
    ASSERT_TRUE(swap->read(ids[2], back.data()).is_ok());
    EXPECT_EQ(std::memcmp(back.data(), data.data(), back.size()), 0);
  }
  EXPECT_FALSE(fs::exists(run));
  EXPECT_TRUE(fs::is_empty(a_.path()));
}

// A failed create() leaves no run directory behind in the directories it already went through.
TEST_F(SwapSpaceTest, FailedCreateRemovesTheRunDirectoriesItMade) {
  auto s = SwapSpace::create(*engine_, {.directories = {a_.path(), b_.path() + "/missing"}});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("missing"), std::string::npos);
  EXPECT_TRUE(fs::is_empty(a_.path()));
}

TEST_F(SwapSpaceTest, BadDirectoriesAreRefused) {
  auto missing = SwapSpace::create(*engine_, {.directories = {a_.path() + "/nope"}});
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  std::string file = a_.file("plain");
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600));
  auto not_dir = SwapSpace::create(*engine_, {.directories = {file}});
  ASSERT_FALSE(not_dir.is_ok());
  EXPECT_NE(not_dir.status().message().find("not a directory"), std::string::npos);
  EXPECT_FALSE(SwapSpace::create(*engine_, {}).is_ok());
}

}  // namespace
}  // namespace zinf::io
