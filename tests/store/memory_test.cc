#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "../io/test_dir.h"
#include "forwarding_device.h"
#include "zinf/io/file.h"
#include "zinf/io/io_engine.h"
#include "zinf/memory/device.h"
#include "zinf/memory/pinned_pool.h"

namespace zinf {
namespace {

TEST(CpuDevice, BudgetIsEnforcedAndAccounted) {
  Ledger ledger;
  auto dev = make_cpu_device({.budget_bytes = 1 << 20, .ledger = &ledger});
  auto a = dev->allocate(600 << 10, MemoryCategory::kParameters);
  ASSERT_TRUE(a.is_ok());
  auto b = dev->allocate(600 << 10, MemoryCategory::kGradients);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("gradients"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("1.00 MiB budget"), std::string::npos)
      << b.status().message();
  EXPECT_EQ(ledger.usage(Tier::kDevice).current, 600u << 10);
  a->reset();
  EXPECT_EQ(ledger.usage(Tier::kDevice).current, 0u);
  EXPECT_EQ(ledger.usage(Tier::kDevice).peak, 600u << 10);
  EXPECT_EQ(dev->bytes_in_use(), 0u);
}

TEST(CpuDevice, StreamRunsInOrderAndEventsWait) {
  auto dev = make_cpu_device({});
  auto s1 = dev->create_stream("a");
  auto s2 = dev->create_stream("b");
  std::vector<int> order;
  std::mutex mu;
  std::atomic<bool> gate{false};
  s1->enqueue([&] {
    while (!gate) std::this_thread::yield();
    std::lock_guard l(mu);
    order.push_back(1);
    return Status::ok();
  });
  Event e1 = s1->record();
  s2->wait_for(e1);  // s2's next work waits for s1, without blocking this thread
  s2->enqueue([&] {
    std::lock_guard l(mu);
    order.push_back(2);
    return Status::ok();
  });
  Event e2 = s2->record();
  EXPECT_FALSE(e2.ready());
  gate = true;
  EXPECT_TRUE(e2.wait().is_ok());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));

  std::vector<char> src(1 << 20, 'x'), dst(1 << 20, 0);
  dev->copy_async(dst.data(), src.data(), src.size(), *s1);
  EXPECT_TRUE(s1->record().wait().is_ok());
  EXPECT_EQ(src, dst);
}

TEST(CpuDevice, StreamErrorsAreStickyUntilSynchronize) {
  auto dev = make_cpu_device({});
  auto s = dev->create_stream("err");
  s->enqueue([] { return Status(ErrorCode::kIo, "boom"); });
  Event e = s->record();
  Status st = e.wait();
  EXPECT_EQ(st.code(), ErrorCode::kIo);
  EXPECT_NE(st.message().find("stream err"), std::string::npos);
  EXPECT_FALSE(s->synchronize().is_ok());
  EXPECT_TRUE(s->synchronize().is_ok());
}

TEST(PinnedPool, ReusesBuffersAndHonoursBudget) {
  Ledger ledger;
  PinnedPool pool({.budget_bytes = 1 << 20, .ledger = &ledger});
  void* first;
  {
    auto a = pool.allocate(300 << 10, MemoryCategory::kOptimizerStates);
    ASSERT_TRUE(a.is_ok());
    first = a->data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 4096, 0u);
    EXPECT_EQ(ledger.usage(Tier::kHost).current_by_category[2], 300u << 10);
  }
  auto b = pool.allocate(300 << 10, MemoryCategory::kGradients);
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->data(), first);  // same size: reused
  EXPECT_EQ(pool.stats().reuses, 1u);
  auto c = pool.allocate(600 << 10, MemoryCategory::kGradients);
  ASSERT_TRUE(c.is_ok());
  auto d = pool.allocate(200 << 10, MemoryCategory::kGradients);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_LE(ledger.usage(Tier::kHost).peak, 1u << 20);
  c->reset();
  // The cached 600 KiB block is released to make room for a different size.
  auto e = pool.allocate(500 << 10, MemoryCategory::kGradients);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_LE(ledger.usage(Tier::kHost).peak, 1u << 20);
}

// Records the host memory registered with it (as CUDA pins it); refuses registration on demand.
class RegisteringDevice final : public test::ForwardingDevice {
 public:
  RegisteringDevice() : ForwardingDevice(make_cpu_device({})) {}
  Status register_host(void* data, uint64_t bytes) override {
    if (refuse) return Status(ErrorCode::kIo, "out of pinnable memory");
    registered[data] = bytes;
    ++registrations;
    return Status::ok();
  }
  void unregister_host(void* data) override {
    EXPECT_EQ(registered.erase(data), 1u) << "unregistered memory that was not registered";
  }
  std::map<void*, uint64_t> registered;
  int registrations = 0;
  bool refuse = false;
};

TEST(PinnedPool, RegistersEachBufferWithTheDeviceWhileItIsMapped) {
  RegisteringDevice device;
  Ledger ledger;
  {
    PinnedPool pool({.budget_bytes = 1 << 20, .ledger = &ledger, .device = &device});
    void* first = nullptr;
    {
      auto a = pool.allocate(300 << 10, MemoryCategory::kOptimizerStates);
      ASSERT_TRUE(a.is_ok());
      first = a->data();
      ASSERT_EQ(device.registered.count(first), 1u);
      EXPECT_EQ(device.registered[first], 300u << 10);
    }
    // Reused from the cache: registered once, not again.
    auto b = pool.allocate(300 << 10, MemoryCategory::kGradients);
    ASSERT_TRUE(b.is_ok());
    EXPECT_EQ(b->data(), first);
    EXPECT_EQ(device.registrations, 1);
    b->reset();
    pool.trim();  // back to the system: unregistered first
    EXPECT_TRUE(device.registered.empty());

    // A refused registration is an error naming the device; nothing is left accounted.
    device.refuse = true;
    auto c = pool.allocate(200 << 10, MemoryCategory::kGradients);
    ASSERT_FALSE(c.is_ok());
    EXPECT_EQ(c.status().code(), ErrorCode::kOutOfMemory);
    EXPECT_NE(c.status().message().find("registering 200.00 KiB of host memory with device cpu"),
              std::string::npos)
        << c.status().message();
    EXPECT_NE(c.status().message().find("out of pinnable memory"), std::string::npos);
    EXPECT_EQ(pool.stats().bytes_in_use, 0u);
    EXPECT_EQ(ledger.usage(Tier::kHost).current, 0u);
    device.refuse = false;
    auto d = pool.allocate(100 << 10, MemoryCategory::kGradients);
    ASSERT_TRUE(d.is_ok());
    EXPECT_EQ(device.registered.size(), 1u);
  }
  // The pool's destruction unregisters what it cached.
  EXPECT_TRUE(device.registered.empty());
}

// Buffers (staging, scratch) serve transfer after transfer and are registered with the I/O engine
// for fixed-buffer I/O; a tensor's copy serves one or two, and registering it would pin every page
// on the ring's thread, which meanwhile moves nothing: it is not registered.
TEST(PinnedPool, RegistersOnlyBuffersWithTheIoEngine) {
  auto engine = io::IoEngine::create({.queue_depth = 4, .block_size = 1 << 20});
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  testing::TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto file = io::File::open(dir.file("pool.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  ASSERT_TRUE(file->preallocate(0, 6 << 20).is_ok());
  PinnedPool pool({.budget_bytes = 64 << 20, .pin = false, .engine = engine->get()});
  {
    auto staging = pool.allocate(2 << 20, MemoryCategory::kBuffers);
    auto tensor = pool.allocate(4 << 20, MemoryCategory::kOptimizerStates);
    ASSERT_TRUE(staging.is_ok());
    ASSERT_TRUE(tensor.is_ok());
    EXPECT_EQ(pool.stats().registered, 1u);
    std::memset(staging->data(), 0x5a, 2 << 20);
    std::memset(tensor->data(), 0xa5, 4 << 20);
    io::IoEngine& e = **engine;
    ASSERT_TRUE(e.write(*file, 0, staging->data(), 2 << 20).is_ok());
    EXPECT_EQ(e.stats().fixed_buffer_chunks, 2u);  // 2 MiB in 1 MiB requests, fixed
    ASSERT_TRUE(e.write(*file, 2 << 20, tensor->data(), 4 << 20).is_ok());
    EXPECT_EQ(e.stats().fixed_buffer_chunks, 2u);  // the tensor's copy went unregistered
    // Both reach the file whole, each way.
    ASSERT_TRUE(e.read(*file, 2 << 20, staging->data(), 2 << 20).is_ok());
    ASSERT_TRUE(e.read(*file, 0, tensor->data(), 2 << 20).is_ok());
    EXPECT_EQ(e.stats().fixed_buffer_chunks, 4u);
    for (uint64_t i = 0; i < (2u << 20); i += 4096) {
      ASSERT_EQ(static_cast<unsigned char*>(staging->data())[i], 0xa5) << i;
      ASSERT_EQ(static_cast<unsigned char*>(tensor->data())[i], 0x5a) << i;
    }
    // A cached buffer keeps its registration when reused, whatever it is reused for.
    staging->reset();
    auto reused = pool.allocate(2 << 20, MemoryCategory::kGradients);
    ASSERT_TRUE(reused.is_ok());
    EXPECT_EQ(pool.stats().reuses, 1u);
    EXPECT_EQ(pool.stats().registered, 1u);
  }
  pool.trim();  // back to the system: unregistered first
  EXPECT_EQ(pool.stats().registered, 0u);
}

}  // namespace
}  // namespace zinf
