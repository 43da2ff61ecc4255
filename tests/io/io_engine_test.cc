#include "zinf/io/io_engine.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/utsname.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "test_dir.h"
#include "zinf/io/aligned_buffer.h"
#include "zinf/io/fault.h"

namespace zinf::io {
namespace {

bool kernel_at_least(int major, int minor) {
  utsname u{};
  int ma = 0, mi = 0;
  if (::uname(&u) != 0 || std::sscanf(u.release, "%d.%d", &ma, &mi) != 2) return false;
  return ma > major || (ma == major && mi >= minor);
}

class IoEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FaultInjector::global().clear();
    ASSERT_FALSE(dir_.path().empty());
  }
  void TearDown() override { FaultInjector::global().clear(); }

  std::unique_ptr<IoEngine> engine(IoEngineOptions o = {}) {
    auto e = IoEngine::create(o);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    return std::move(e).value();
  }
  File open_file(const std::string& name, uint64_t prealloc = 0) {
    auto f = File::open(dir_.file(name), {.create = true});
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    if (prealloc) {
      EXPECT_TRUE(f->preallocate(0, prealloc).is_ok());
    }
    return std::move(f).value();
  }
  static void fill_random(AlignedBuffer& b, uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto* w = reinterpret_cast<uint64_t*>(b.data());
    for (size_t i = 0; i < b.size() / 8; ++i) w[i] = rng();
  }

  testing::TempDir dir_;
};

TEST_F(IoEngineTest, OpensDirectAndLearnsAlignment) {
  File f = open_file("a.bin");
  EXPECT_TRUE(f.direct());
  EXPECT_GE(f.offset_alignment(), 512u);
  EXPECT_LE(f.offset_alignment(), 4096u);
  EXPECT_GE(f.mem_alignment(), 1u);
}

TEST_F(IoEngineTest, RoundTripsRandomSizesAndOffsetsWithChecksums) {
  auto e = engine({.queue_depth = 8, .block_size = 64 << 10});
  File f = open_file("rt.bin", 64 << 20);
  std::mt19937_64 rng(42);
  const uint64_t align = 4096;
  for (int i = 0; i < 40; ++i) {
    uint64_t blocks = 1 + rng() % 300;  // up to ~1.2 MiB: several chunks of 64 KiB
    uint64_t offset = (rng() % 10000) * align;
    AlignedBuffer out(blocks * align), in(blocks * align);
    fill_random(out, rng());
    ASSERT_TRUE(e->write(f, offset, out.data(), out.size()).is_ok());
    ASSERT_TRUE(e->read(f, offset, in.data(), in.size()).is_ok());
    ASSERT_EQ(XXH3_64bits(out.data(), out.size()), XXH3_64bits(in.data(), in.size()))
        << "size " << out.size() << " offset " << offset;
  }
  IoStats s = e->stats();
  EXPECT_GT(s.chunks_submitted, 80u);  // large requests were split into 64 KiB chunks
  EXPECT_EQ(s.requests_failed, 0u);
  EXPECT_EQ(s.bytes_read, s.bytes_written);
}

// aio.single_submit: each chunk is its own io_uring_enter; the data is the same.
TEST_F(IoEngineTest, SingleSubmitRoundTrips) {
  auto e = engine({.queue_depth = 8, .block_size = 64 << 10, .single_submit = true});
  File f = open_file("single.bin", 8 << 20);
  AlignedBuffer out(4 << 20), in(4 << 20);
  fill_random(out, 7);
  ASSERT_TRUE(e->write(f, 1 << 20, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 1 << 20, in.data(), in.size()).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(e->stats().chunks_submitted, 2u * (4 << 20) / (64 << 10));
}

TEST_F(IoEngineTest, RefusesMisalignedRequestsClearly) {
  auto e = engine();
  File f = open_file("mis.bin", 1 << 20);
  AlignedBuffer b(3 * 4096);
  struct Case {
    void* buf;
    uint64_t offset, length;
  } cases[] = {{b.data() + 1, 0, 4096}, {b.data(), 100, 4096}, {b.data(), 0, 1000}};
  for (auto c : cases) {
    Status s = e->write(f, c.offset, c.buf, c.length);
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(s.message().find("misaligned"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(f.path()), std::string::npos) << s.message();
  }
  Status zero = e->read(f, 0, b.data(), 0);
  EXPECT_EQ(zero.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e->stats().chunks_submitted, 0u);  // nothing reached the kernel
}

TEST_F(IoEngineTest, InjectedShortTransfersContinue) {
  auto e = engine({.queue_depth = 4, .block_size = 256 << 10});
  File f = open_file("short.bin", 8 << 20);
  ASSERT_TRUE(FaultInjector::global().add_spec("any:every:short").is_ok());
  AlignedBuffer out(4 << 20), in(4 << 20);
  fill_random(out, 7);
  ASSERT_TRUE(e->write(f, 4096, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 4096, in.data(), in.size()).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  IoStats s = e->stats();
  EXPECT_GT(s.short_continuations, 16u);
  EXPECT_EQ(s.bytes_written, out.size());
  EXPECT_EQ(s.bytes_read, in.size());
}

TEST_F(IoEngineTest, EagainIsResubmitted) {
  auto e = engine({.queue_depth = 4, .block_size = 64 << 10});
  File f = open_file("again.bin", 1 << 20);
  FaultInjector::global().add({.op = IoOp::kWrite, .nth = 2, .kind = FaultKind::kEagain});
  FaultInjector::global().add({.op = IoOp::kRead, .nth = 1, .kind = FaultKind::kEagain});
  AlignedBuffer out(512 << 10), in(512 << 10);
  fill_random(out, 9);
  ASSERT_TRUE(e->write(f, 0, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(e->stats().retries, 2u);
}

TEST_F(IoEngineTest, EndlessEagainFailsAfterBoundedRetries) {
  auto e = engine({.queue_depth = 2, .max_retries = 5});
  File f = open_file("again2.bin", 1 << 20);
  ASSERT_TRUE(FaultInjector::global().add_spec("read:every:eagain").is_ok());
  AlignedBuffer in(4096);
  Status s = e->read(f, 0, in.data(), in.size());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("gave up after 5 retries"), std::string::npos) << s.message();
}

TEST_F(IoEngineTest, InjectedErrorsNameFileAndOffset) {
  auto e = engine({.queue_depth = 4, .block_size = 64 << 10});
  File f = open_file("err.bin", 4 << 20);
  AlignedBuffer b(1 << 20);
  fill_random(b, 1);
  // The 3rd write chunk fails with EIO: the request fails, naming the chunk's offset.
  FaultInjector::global().add({.op = IoOp::kWrite, .nth = 3, .kind = FaultKind::kEio});
  Status s = e->write(f, 1 << 20, b.data(), b.size());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), ErrorCode::kIo);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find(f.path()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset " + std::to_string((1 << 20) + 2 * (64 << 10))),
            std::string::npos)
      << s.message();

  FaultInjector::global().clear();
  FaultInjector::global().add({.op = IoOp::kRead, .nth = 1, .kind = FaultKind::kEnospc});
  Status r = e->read(f, 0, b.data(), 4096);
  EXPECT_EQ(r.code(), ErrorCode::kNoSpace);
  EXPECT_NE(r.to_string().find("No space left"), std::string::npos);
  EXPECT_EQ(e->stats().requests_failed, 2u);
  // The engine keeps working after errors.
  FaultInjector::global().clear();
  EXPECT_TRUE(e->write(f, 0, b.data(), b.size()).is_ok());
}

TEST_F(IoEngineTest, ReadPastEndOfFileIsAnError) {
  auto e = engine();
  File f = open_file("eof.bin", 4096);
  AlignedBuffer b(8192);
  Status s = e->read(f, 4096, b.data(), b.size());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("unexpected end of file"), std::string::npos) << s.message();
}

TEST_F(IoEngineTest, DirectRefusalFallsBackToBufferedIo) {
  FaultInjector::global().set_refuse_direct(true);
  File f = open_file("buffered.bin");
  EXPECT_FALSE(f.direct());
  EXPECT_EQ(f.offset_alignment(), 1u);
  auto e = engine();
  std::vector<char> out(10000, 'z'), in(10000);  // unaligned sizes are fine when buffered
  ASSERT_TRUE(e->write(f, 3, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 3, in.data(), in.size()).is_ok());
  EXPECT_EQ(out, in);
}

TEST_F(IoEngineTest, EnvironmentSpecIsParsedAndBadSpecsNamed) {
  EXPECT_TRUE(
      FaultInjector::global().add_spec("write:3:eio,read:2+:short:swap,direct:refuse").is_ok());
  EXPECT_TRUE(FaultInjector::global().refuse_direct());
  for (const char* bad : {"write:0:eio", "write:x:eio", "nope:1:eio", "read:1:boom", "read:1"}) {
    Status s = FaultInjector::global().add_spec(bad);
    ASSERT_FALSE(s.is_ok()) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
}

TEST_F(IoEngineTest, SubmitCorruptAndHangRulesAreParsed) {
  EXPECT_TRUE(
      FaultInjector::global().add_spec("submit:every:eio,read:2:corrupt,any:1:hang").is_ok());
  for (const char* bad : {"write:1:corrupt", "any:1:corrupt", "submit:1:short", "submit:1:hang",
                          "submit:1:eio:swap"}) {
    Status s = FaultInjector::global().add_spec(bad);
    ASSERT_FALSE(s.is_ok()) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
}

// A persistent io_uring_enter failure is not retried for ever: after submit_retry_ms the ring is
// broken, the request fails naming the ring, the errno, the file and the offset, later requests
// fail at once, and the engine is destroyed without waiting.
TEST_F(IoEngineTest, PersistentSubmitFailureBecomesAnErrorAfterABoundedRetry) {
  auto start = std::chrono::steady_clock::now();
  {
    auto e = engine({.queue_depth = 4, .submit_retry_ms = 50});
    File f = open_file("submit.bin", 1 << 20);
    ASSERT_TRUE(FaultInjector::global().add_spec("submit:every:eio").is_ok());
    AlignedBuffer b(8192);
    Status s = e->read(f, 4096, b.data(), b.size());
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.sys_errno(), EIO);
    for (const std::string& part :
         {std::string("ring 0 is broken"), std::string("submit_retry_ms = 50"), f.path(),
          std::string("read of 8192 bytes at offset 4096")}) {
      EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
    }
    Status later = e->write(f, 0, b.data(), b.size());
    ASSERT_FALSE(later.is_ok());
    EXPECT_NE(later.message().find("is broken"), std::string::npos) << later.message();
    EXPECT_EQ(e->stats().requests_failed, 2u);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// A submission that fails once is retried and the request completes.
TEST_F(IoEngineTest, TransientSubmitFailureIsRetried) {
  auto e = engine({.queue_depth = 4, .submit_retry_ms = 5000});
  File f = open_file("transient.bin", 1 << 20);
  AlignedBuffer out(4096), in(4096);
  fill_random(out, 9);
  ASSERT_TRUE(FaultInjector::global().add_spec("submit:1:eio,submit:2:eagain").is_ok());
  ASSERT_TRUE(e->write(f, 0, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.size()), 0);
  EXPECT_EQ(FaultInjector::global().fired(), 2u);
}

// A request that never completes: drain() gives up after its timeout naming how many are
// outstanding, and destruction returns after drain_timeout_ms instead of waiting for ever.
TEST_F(IoEngineTest, DrainAndDestructionHaveDeadlines) {
  File f = open_file("hang.bin", 1 << 20);
  AlignedBuffer b(4096);
  std::atomic<bool> called{false};
  auto start = std::chrono::steady_clock::now();
  {
    auto e = engine({.queue_depth = 4, .drain_timeout_ms = 200});
    ASSERT_TRUE(FaultInjector::global().add_spec("read:1:hang").is_ok());
    ASSERT_TRUE(
        e->submit(
             {.op = IoOp::kRead, .file = &f, .offset = 0, .buffer = b.data(), .length = b.size()},
             [&](Status) { called = true; })
            .is_ok());
    Status d = e->drain(std::chrono::milliseconds(50));
    ASSERT_FALSE(d.is_ok());
    EXPECT_EQ(d.code(), ErrorCode::kTimeout);
    EXPECT_NE(d.message().find("1 I/O request(s) still outstanding"), std::string::npos)
        << d.message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_FALSE(called.load()) << "an abandoned request does not call back";
}

// `corrupt`: the read completes with exactly one byte changed (what the checksums must catch).
TEST_F(IoEngineTest, CorruptFaultFlipsOneByteOfARead) {
  auto e = engine();
  File f = open_file("corrupt.bin", 1 << 20);
  AlignedBuffer out(8192), in(8192);
  fill_random(out, 4);
  ASSERT_TRUE(e->write(f, 0, out.data(), out.size()).is_ok());
  ASSERT_TRUE(FaultInjector::global().add_spec("read:1:corrupt").is_ok());
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());
  size_t differing = 0;
  for (size_t i = 0; i < in.size(); ++i) differing += in.data()[i] != out.data()[i];
  EXPECT_EQ(differing, 1u);
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());  // the rule fired once
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.size()), 0);
}

TEST_F(IoEngineTest, RegisteredBuffersAndFilesAreUsed) {
  auto e = engine({.queue_depth = 8, .block_size = 128 << 10});
  File f = open_file("fixed.bin", 4 << 20);
  ASSERT_TRUE(e->register_file(f).is_ok());
  AlignedBuffer out(2 << 20), in(2 << 20);
  fill_random(out, 3);
  auto so = e->register_buffer(out.data(), out.size());
  auto si = e->register_buffer(in.data(), in.size());
  ASSERT_TRUE(so.is_ok()) << so.status().to_string();
  ASSERT_TRUE(si.is_ok()) << si.status().to_string();
  ASSERT_TRUE(e->write(f, 0, out.data(), out.size()).is_ok());
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(e->stats().fixed_buffer_chunks, 32u);  // 2 x 2 MiB in 128 KiB chunks
  EXPECT_EQ(e->stats().fixed_file_chunks, 32u);
  // A request that straddles past the registered range falls back to a plain read.
  EXPECT_TRUE(e->unregister_buffer(*so).is_ok());
  EXPECT_TRUE(e->unregister_buffer(*si).is_ok());
  EXPECT_FALSE(e->unregister_buffer(*si).is_ok());
  ASSERT_TRUE(e->read(f, 0, in.data(), in.size()).is_ok());
  EXPECT_EQ(e->stats().fixed_buffer_chunks, 32u);
  EXPECT_TRUE(e->unregister_file(f).is_ok());
}

// With single-issuer rings (the default where the kernel has them) only a ring's own thread may
// register on it: buffers and files registered from the caller's thread must still reach every
// ring, so that each ring's chunks use them.
TEST_F(IoEngineTest, RegistrationsReachEveryRingFromAnyThread) {
  for (bool defer : {true, false}) {
    SCOPED_TRACE(defer ? "defer_taskrun" : "plain rings");
    auto e = engine({.queue_depth = 4, .block_size = 64 << 10, .rings = 3, .defer_taskrun = defer});
    if (!defer) {
      EXPECT_EQ(e->stats().deferred_rings, 0u);
    } else if (kernel_at_least(6, 1)) {
      EXPECT_EQ(e->stats().deferred_rings, 3u) << "the kernel refused SINGLE_ISSUER";
    }
    File f = open_file(defer ? "reg-d.bin" : "reg-p.bin", 4 << 20);
    ASSERT_TRUE(e->register_file(f).is_ok());
    AlignedBuffer out(3 << 20), in(3 << 20);
    fill_random(out, 21);
    auto so = e->register_buffer(out.data(), out.size());
    auto si = e->register_buffer(in.data(), in.size());
    ASSERT_TRUE(so.is_ok()) << so.status().to_string();
    ASSERT_TRUE(si.is_ok()) << si.status().to_string();
    // One request per 64 KiB so that the round robin gives every ring some.
    for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
      AlignedBuffer& b = op == IoOp::kWrite ? out : in;
      for (uint64_t off = 0; off < b.size(); off += 64 << 10) {
        ASSERT_TRUE(e->submit(IoRequest{.op = op,
                                        .file = &f,
                                        .offset = off,
                                        .buffer = b.data() + off,
                                        .length = 64 << 10},
                              [](Status st) { EXPECT_TRUE(st.is_ok()) << st.to_string(); })
                        .is_ok());
      }
      ASSERT_TRUE(e->drain().is_ok());
    }
    EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
    EXPECT_EQ(e->stats().fixed_buffer_chunks, 96u);  // 2 x 3 MiB in 64 KiB chunks
    EXPECT_EQ(e->stats().fixed_file_chunks, 96u);
    EXPECT_EQ(e->stats().requests_failed, 0u);
    EXPECT_TRUE(e->unregister_buffer(*so).is_ok());
    EXPECT_TRUE(e->unregister_buffer(*si).is_ok());
    EXPECT_TRUE(e->unregister_file(f).is_ok());
    // The slots are free again and reusable.
    auto again = e->register_buffer(in.data(), in.size());
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    ASSERT_TRUE(e->read(f, 0, in.data(), 64 << 10).is_ok());
    EXPECT_EQ(e->stats().fixed_buffer_chunks, 97u);
  }
}

// Registering must not wait for a ring's thread: callers (SwapSpace::allocate) register while
// holding a lock that their completion callbacks take. Here a callback is held on a gate while
// another thread registers and unregisters; those calls must return with the gate still shut,
// and what they registered must be used once the ring runs again.
TEST_F(IoEngineTest, RegistrationsNeverWaitForABusyRing) {
  for (uint32_t rings : {1u, 2u}) {
    SCOPED_TRACE(::testing::Message() << rings << " ring(s)");
    auto e = engine({.queue_depth = 4, .rings = rings});
    File f = open_file(fmt::format("gate-{}.bin", rings), 1 << 20);
    File g = open_file(fmt::format("gate2-{}.bin", rings), 1 << 20);
    AlignedBuffer a(4096 * rings), b(4096 * rings);
    std::memset(a.data(), 0x3c, a.size());
    auto old_slot = e->register_buffer(b.data(), b.size());
    ASSERT_TRUE(old_slot.is_ok()) << old_slot.status().to_string();
    std::promise<void> gate;
    std::shared_future<void> open = gate.get_future().share();
    std::atomic<int> held{0};
    for (uint32_t r = 0; r < rings; ++r) {  // one blocked callback per ring (round robin)
      ASSERT_TRUE(e->submit(IoRequest{.op = IoOp::kWrite,
                                      .file = &f,
                                      .offset = 4096ull * r,
                                      .buffer = a.data() + 4096 * r,
                                      .length = 4096},
                            [&](Status st) {
                              EXPECT_TRUE(st.is_ok());
                              ++held;
                              open.wait();
                            })
                      .is_ok());
    }
    while (held.load() < static_cast<int>(rings)) std::this_thread::yield();
    auto registering = std::async(std::launch::async, [&] {
      EXPECT_TRUE(e->register_file(g).is_ok());
      EXPECT_TRUE(e->unregister_buffer(*old_slot).is_ok());
      auto slot = e->register_buffer(a.data(), a.size());
      EXPECT_TRUE(slot.is_ok()) << slot.status().to_string();
    });
    const bool returned =
        registering.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    gate.set_value();
    registering.wait();
    EXPECT_TRUE(returned) << "registering waited for a ring whose thread was busy";
    ASSERT_TRUE(e->drain().is_ok());
    const uint64_t fixed = e->stats().fixed_buffer_chunks;
    // The new registrations (file g, buffer a) are in use on every ring.
    const uint64_t fixed_files = e->stats().fixed_file_chunks;
    for (uint32_t r = 0; r < rings; ++r) {
      ASSERT_TRUE(e->write(g, 4096ull * r, a.data() + 4096 * r, 4096).is_ok());
    }
    EXPECT_EQ(e->stats().fixed_buffer_chunks, fixed + rings);
    EXPECT_EQ(e->stats().fixed_file_chunks, fixed_files + rings);
    ASSERT_TRUE(e->read(f, 0, b.data(), b.size()).is_ok());
    EXPECT_EQ(e->stats().fixed_buffer_chunks, fixed + rings);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0);
  }
}

// A completion callback may register too (its own ring applies it at once, the others before
// their next request).
TEST_F(IoEngineTest, CallbacksMayRegister) {
  auto e = engine({.queue_depth = 4, .rings = 2});
  File f = open_file("cb-reg.bin", 1 << 20);
  AlignedBuffer a(4096), b(8192);
  std::memset(a.data(), 0x5e, a.size());
  std::promise<bool> registered;
  ASSERT_TRUE(
      e->submit(IoRequest{.op = IoOp::kWrite, .file = &f, .buffer = a.data(), .length = 4096},
                [&](Status st) {
                  EXPECT_TRUE(st.is_ok());
                  registered.set_value(e->register_buffer(b.data(), b.size()).is_ok());
                })
          .is_ok());
  auto fut = registered.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  ASSERT_TRUE(fut.get());
  const uint64_t fixed = e->stats().fixed_buffer_chunks;
  ASSERT_TRUE(e->read(f, 0, b.data(), 4096).is_ok());
  ASSERT_TRUE(e->read(f, 0, b.data() + 4096, 4096).is_ok());
  EXPECT_EQ(e->stats().fixed_buffer_chunks, fixed + 2);  // both rings
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 4096), 0);
  EXPECT_EQ(std::memcmp(a.data(), b.data() + 4096, 4096), 0);
}

TEST_F(IoEngineTest, ThousandsOfConcurrentRequestsCompleteExactlyOnce) {
  auto e = engine({.queue_depth = 16, .block_size = 16 << 10, .rings = 3});
  File f = open_file("many.bin", 16 << 20);
  constexpr int kThreads = 4, kPerThread = 1500;
  constexpr uint64_t kBlock = 4096;
  AlignedBuffer data(kThreads * kPerThread * kBlock);
  fill_random(data, 11);
  std::vector<std::atomic<int>> calls(kThreads * kPerThread);
  std::atomic<int> failures{0};
  // A few injected faults along the way must not lose or duplicate any completion.
  ASSERT_TRUE(
      FaultInjector::global().add_spec("write:500:eio,write:900:short,read:77:eagain").is_ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        int id = t * kPerThread + i;
        uint64_t off = static_cast<uint64_t>(id) * kBlock;
        Status s = e->submit(IoRequest{.op = IoOp::kWrite,
                                       .file = &f,
                                       .offset = off,
                                       .buffer = data.data() + off,
                                       .length = kBlock},
                             [&, id](Status st) {
                               calls[id].fetch_add(1);
                               if (!st.is_ok()) failures.fetch_add(1);
                             });
        ASSERT_TRUE(s.is_ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(e->drain().is_ok());
  for (int i = 0; i < kThreads * kPerThread; ++i) ASSERT_EQ(calls[i].load(), 1) << "request " << i;
  EXPECT_EQ(failures.load(), 1);  // exactly the one injected EIO
  IoStats s = e->stats();
  EXPECT_EQ(s.requests_completed + s.requests_failed, uint64_t{kThreads * kPerThread});
  EXPECT_EQ(s.requests_failed, 1u);
}

TEST_F(IoEngineTest, CallbacksMayResubmit) {
  auto e = engine({.queue_depth = 4});
  File f = open_file("chain.bin", 1 << 20);
  AlignedBuffer b(4096);
  std::memset(b.data(), 0x5a, b.size());
  std::atomic<int> remaining{100};
  std::promise<void> finished;
  std::function<void(Status)> next = [&](Status s) {
    ASSERT_TRUE(s.is_ok());
    int left = --remaining;
    if (left == 0) {
      finished.set_value();
      return;
    }
    ASSERT_TRUE(e->submit(IoRequest{.op = IoOp::kWrite,
                                    .file = &f,
                                    .offset = static_cast<uint64_t>(left) * 4096,
                                    .buffer = b.data(),
                                    .length = 4096},
                          next)
                    .is_ok());
  };
  ASSERT_TRUE(
      e->submit(IoRequest{.op = IoOp::kWrite, .file = &f, .buffer = b.data(), .length = 4096}, next)
          .is_ok());
  finished.get_future().wait();
  ASSERT_TRUE(e->drain().is_ok());
  EXPECT_EQ(e->stats().requests_completed, 100u);
}

// With one chunk slot, a request completes from inside the ring's fill step; a resubmission from
// that callback must still be picked up (no lost wake-up).
TEST_F(IoEngineTest, ResubmitFromCompletionWithQueueDepthOne) {
  auto e = engine({.queue_depth = 1, .rings = 1});
  File f = open_file("qd1.bin", 1 << 20);
  AlignedBuffer b(4096);
  std::memset(b.data(), 0x11, b.size());
  std::atomic<int> remaining{50};
  std::promise<void> finished;
  std::function<void(Status)> next = [&](Status s) {
    EXPECT_TRUE(s.is_ok());
    if (--remaining == 0) {
      finished.set_value();
      return;
    }
    EXPECT_TRUE(
        e->submit(IoRequest{.op = IoOp::kWrite, .file = &f, .buffer = b.data(), .length = 4096},
                  next)
            .is_ok());
  };
  ASSERT_TRUE(
      e->submit(IoRequest{.op = IoOp::kWrite, .file = &f, .buffer = b.data(), .length = 4096}, next)
          .is_ok());
  ASSERT_EQ(finished.get_future().wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "the ring stopped picking up resubmitted requests";
  ASSERT_TRUE(e->drain().is_ok());
}

TEST(IoEngineOptionsTest, BadOptionsAreRefused) {
  EXPECT_FALSE(IoEngine::create({.queue_depth = 0}).is_ok());
  EXPECT_FALSE(IoEngine::create({.block_size = 0}).is_ok());
  EXPECT_FALSE(IoEngine::create({.rings = 0}).is_ok());
}

}  // namespace
}  // namespace zinf::io
