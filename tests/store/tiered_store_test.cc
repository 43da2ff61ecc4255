#include "zinf/store/tiered_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "test_dir.h"
#include "zinf/io/fault.h"

namespace zinf {
namespace {

uint64_t word(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
void fill(void* p, uint64_t bytes, uint64_t seed) {
  auto* w = static_cast<uint64_t*>(p);
  for (uint64_t i = 0; i < bytes / 8; ++i) w[i] = seed == 0 ? 0 : word(seed, i);
}
// Index of the first wrong word, or -1.
int64_t check(const void* p, uint64_t bytes, uint64_t seed) {
  auto* w = static_cast<const uint64_t*>(p);
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    if (w[i] != (seed == 0 ? 0 : word(seed, i))) return static_cast<int64_t>(i);
  }
  return -1;
}

struct StoreSetup {
  uint64_t device_budget = 8 << 20;
  uint64_t host_budget = 16 << 20;
  uint64_t staging = 1 << 20;
  bool checksum = true;
};

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { io::FaultInjector::global().clear(); }
  void TearDown() override {
    store_.reset();
    pool_.reset();
    swap_.reset();
    engine_.reset();
    io::FaultInjector::global().clear();
  }

  void build(const StoreSetup& s = {}) {
    setup_ = s;
    engine_ = std::move(io::IoEngine::create({.queue_depth = 16, .block_size = 512 << 10})).value();
    swap_ = std::move(io::SwapSpace::create(*engine_, {.directories = {dir_.path()},
                                                       .file_bytes = 8 << 20,
                                                       .checksum = s.checksum}))
                .value();
    // The device of $ZINF_DEVICE: ctest runs these tests on the strict one too, so the store is
    // shown never to touch device memory outside the device's operations.
    device_ = std::move(make_device(resolve_device_kind(DeviceKind::kAuto).value(),
                                    {.budget_bytes = s.device_budget, .ledger = &ledger_}))
                  .value();
    pool_ = std::make_unique<PinnedPool>(PinnedPoolOptions{
        .budget_bytes = s.host_budget, .pin = false, .engine = engine_.get(), .ledger = &ledger_});
    auto st = TieredTensorStore::create({.device = device_.get(),
                                         .host = pool_.get(),
                                         .swap = swap_.get(),
                                         .ledger = &ledger_,
                                         .staging_bytes = s.staging,
                                         .staging_buffers = 2,
                                         .movers = 2});
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    store_ = std::move(st).value();
  }

  TensorId make(const std::string& name, uint64_t bytes, Tier home) {
    auto id = store_->create_tensor({.name = name, .bytes = bytes, .home = home});
    EXPECT_TRUE(id.is_ok()) << id.status().to_string();
    return *id;
  }

  // The test pattern written into / checked in a copy, through the device when it is there.
  void fill_at(const TensorHandle& h, uint64_t seed) {
    if (h.tier() != Tier::kDevice) return fill(h.data(), h.bytes(), seed);
    std::vector<char> host(h.bytes());
    fill(host.data(), host.size(), seed);
    auto stream = device_->create_stream("test");
    device_->copy_async(h.data(), host.data(), host.size(), *stream);
    EXPECT_TRUE(stream->synchronize().is_ok());
  }
  int64_t check_at(const TensorHandle& h, uint64_t seed) {
    if (h.tier() != Tier::kDevice) return check(h.data(), h.bytes(), seed);
    std::vector<char> host(h.bytes());
    auto stream = device_->create_stream("test");
    device_->copy_async(host.data(), h.data(), host.size(), *stream);
    EXPECT_TRUE(stream->synchronize().is_ok());
    return check(host.data(), host.size(), seed);
  }

  void write(TensorId id, Tier tier, uint64_t seed) {
    auto h = store_->acquire(id, tier);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    fill_at(*h, seed);
    h->mark_dirty();
  }
  void expect(TensorId id, Tier tier, uint64_t seed) {
    auto h = store_->acquire(id, tier);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    EXPECT_EQ(check_at(*h, seed), -1) << "tensor " << id << " on " << tier_name(tier);
  }
  void expect_within_budgets() {
    EXPECT_LE(ledger_.usage(Tier::kDevice).peak, setup_.device_budget);
    EXPECT_LE(ledger_.usage(Tier::kHost).peak, setup_.host_budget);
  }

  StoreSetup setup_;
  testing::TempDir dir_;
  Ledger ledger_;
  std::unique_ptr<io::IoEngine> engine_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<TieredTensorStore> store_;
};

TEST_F(StoreTest, NewTensorsAreZeroInEveryHome) {
  build();
  for (Tier home : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    TensorId id = make(std::string(tier_name(home)), 20000, home);
    EXPECT_EQ(store_->padded_bytes(id), 20480u);
    expect(id, Tier::kDevice, 0);
    expect(id, Tier::kHost, 0);
  }
}

TEST_F(StoreTest, DirtyCopiesAreWrittenBackAndServedFromEveryTier) {
  build();
  TensorId id = make("blocks.0.params", 3 << 20, Tier::kNvme);
  write(id, Tier::kDevice, 7);
  Residency r = store_->residency(id);
  EXPECT_TRUE(r.valid[0]);
  EXPECT_FALSE(r.valid[2]);  // NVMe is stale until written back
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  r = store_->residency(id);
  EXPECT_FALSE(r.allocated[0]);
  EXPECT_TRUE(r.valid[2]);
  expect(id, Tier::kHost, 7);    // NVMe -> host
  expect(id, Tier::kDevice, 7);  // host -> device
  write(id, Tier::kHost, 8);
  ASSERT_TRUE(store_->flush(id).is_ok());
  EXPECT_TRUE(store_->residency(id).valid[2]);
  ASSERT_TRUE(store_->evict(id, Tier::kHost).is_ok());
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  expect(id, Tier::kDevice, 8);  // NVMe -> device through staging, in 1 MiB pieces
  StoreStats s = store_->stats();
  EXPECT_GE(s.writebacks, 2u);
  EXPECT_GT(s.bytes_nvme_read, 0u);
  EXPECT_EQ(store_->evict(id, Tier::kNvme).code(), ErrorCode::kInvalidArgument);
}

TEST_F(StoreTest, OverwriteAccessFetchesNothing) {
  build();
  TensorId id = make("grad_acc", 2 << 20, Tier::kNvme);
  write(id, Tier::kHost, 3);
  ASSERT_TRUE(store_->evict(id, Tier::kHost).is_ok());
  uint64_t read_before = store_->stats().bytes_nvme_read;
  {
    auto h = store_->acquire(id, Tier::kDevice, Access::kOverwrite);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    Residency r = store_->residency(id);
    EXPECT_TRUE(r.valid[0]);
    EXPECT_FALSE(r.valid[2]);  // the NVMe copy is stale from now on
    fill_at(*h, 4);
    h->mark_dirty();
  }
  EXPECT_EQ(store_->stats().bytes_nvme_read, read_before);  // nothing was fetched
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  expect(id, Tier::kHost, 4);
}

// A copy the store is reading for its own move (here: the host copy a prefetch copies to the
// device) is not "pinned": evict() waits for the move instead of failing, and both the moved
// copy and the home hold the data afterwards.
TEST_F(StoreTest, EvictWaitsForAMoveReadingTheCopy) {
  build({.device_budget = 256 << 20, .host_budget = 256 << 20});
  for (int round = 0; round < 8; ++round) {
    TensorId id = make("t" + std::to_string(round), 32 << 20, Tier::kNvme);
    write(id, Tier::kHost, 100 + round);  // the only valid copy is on the host
    store_->prefetch(id, Tier::kDevice);  // reads the host copy
    Status st = store_->evict(id, Tier::kHost);
    ASSERT_TRUE(st.is_ok()) << "round " << round << ": " << st.to_string();
    EXPECT_FALSE(store_->residency(id).allocated[static_cast<int>(Tier::kHost)]);
    expect(id, Tier::kDevice, 100 + round);
    ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
    expect(id, Tier::kHost, 100 + round);  // from the NVMe home
    ASSERT_TRUE(store_->evict(id, Tier::kHost).is_ok());
    ASSERT_TRUE(store_->destroy_tensor(id).is_ok());
  }
}

TEST_F(StoreTest, TensorsLargerThanStagingMoveInPieces) {
  build({.device_budget = 16 << 20, .staging = 1 << 20});
  TensorId id = make("big", (5 << 20) + 12345, Tier::kNvme);
  write(id, Tier::kDevice, 99);
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());  // device -> NVMe in 6 pieces
  uint64_t read_before = store_->stats().bytes_nvme_read;
  expect(id, Tier::kDevice, 99);  // NVMe -> device in 6 pieces
  EXPECT_EQ(store_->stats().bytes_nvme_read - read_before, store_->padded_bytes(id));
}

TEST_F(StoreTest, BudgetsHoldByEvictingFarthestNextUseFirst) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  for (int i = 0; i < 4; ++i) expect(ids[i], Tier::kDevice, 0);
  // t0 is needed soonest, t3 last: bringing t4 in must evict t3.
  for (int i = 0; i < 4; ++i) store_->set_next_use(ids[i], 100 + i);
  expect(ids[4], Tier::kDevice, 0);
  EXPECT_FALSE(store_->residency(ids[3]).allocated[0]);
  EXPECT_TRUE(store_->residency(ids[0]).allocated[0]);
  expect_within_budgets();
}

TEST_F(StoreTest, EverythingPinnedIsAClearOutOfMemory) {
  build({.device_budget = 2 << 20});
  TensorId a = make("a", 1 << 20, Tier::kHost), b = make("b", 1 << 20, Tier::kHost);
  TensorId c = make("layer.c", 1 << 20, Tier::kHost);
  auto ha = store_->acquire(a, Tier::kDevice);
  auto hb = store_->acquire(b, Tier::kDevice);
  ASSERT_TRUE(ha.is_ok() && hb.is_ok());
  auto hc = store_->acquire(c, Tier::kDevice);
  ASSERT_FALSE(hc.is_ok());
  EXPECT_EQ(hc.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(hc.status().message().find("layer.c"), std::string::npos) << hc.status().message();
  ha->release();
  EXPECT_TRUE(store_->acquire(c, Tier::kDevice).is_ok());
}

TEST_F(StoreTest, IoErrorsReachTheCallerAndLoseNothing) {
  build();
  TensorId id = make("optimizer.m.3", 2 << 20, Tier::kNvme);
  write(id, Tier::kDevice, 5);
  // The write-back fails: the dirty device copy stays valid and the error names the tensor.
  io::FaultInjector::global().add({.op = io::IoOp::kWrite, .nth = 1, .kind = io::FaultKind::kEio});
  Status s = store_->evict(id, Tier::kDevice);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("optimizer.m.3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("swap-"), std::string::npos) << s.message();
  EXPECT_TRUE(store_->residency(id).valid[0]);
  expect(id, Tier::kDevice, 5);
  io::FaultInjector::global().clear();
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  // The read fails: acquire reports it; NVMe still holds the data; a retry succeeds.
  io::FaultInjector::global().add({.op = io::IoOp::kRead, .nth = 1, .kind = io::FaultKind::kEio});
  auto h = store_->acquire(id, Tier::kDevice);
  ASSERT_FALSE(h.is_ok());
  EXPECT_NE(h.status().message().find("optimizer.m.3"), std::string::npos);
  EXPECT_TRUE(store_->residency(id).valid[2]);
  io::FaultInjector::global().clear();
  expect(id, Tier::kDevice, 5);
}

// Thousands of random operations against a model of what each tensor must hold.
TEST_F(StoreTest, RandomizedOperationsMatchModel) {
  build({.device_budget = 6 << 20, .host_budget = 40 << 20, .staging = 1 << 20});
  std::mt19937_64 rng(2024);
  struct ModelTensor {
    TensorId id;
    uint64_t seed;
  };
  std::vector<ModelTensor> model;
  const Tier homes[] = {Tier::kDevice, Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kNvme};
  uint64_t device_homed = 0;
  for (int i = 0; i < 40; ++i) {
    uint64_t bytes = 4096 + rng() % (3 << 19);
    Tier home = homes[rng() % 5];
    if (home == Tier::kDevice && device_homed + bytes > (2 << 20)) home = Tier::kHost;
    if (home == Tier::kDevice) device_homed += (bytes + 4095) / 4096 * 4096;
    model.push_back({make("tensor" + std::to_string(i), bytes, home), 0});
  }
  uint64_t next_seed = 1;
  for (int step = 0; step < 3000; ++step) {
    ModelTensor& m = model[rng() % model.size()];
    Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
    switch (rng() % 7) {
      case 0:
      case 1: {  // read and verify
        auto h = store_->acquire(m.id, tier);
        ASSERT_TRUE(h.is_ok()) << "step " << step << ": " << h.status().to_string();
        ASSERT_EQ(check_at(*h, m.seed), -1) << "step " << step;
        break;
      }
      case 2:
      case 3: {  // overwrite
        auto h = store_->acquire(m.id, tier);
        ASSERT_TRUE(h.is_ok()) << "step " << step << ": " << h.status().to_string();
        m.seed = next_seed++;
        fill_at(*h, m.seed);
        h->mark_dirty();
        break;
      }
      case 4:
        store_->prefetch(m.id, tier);
        break;
      case 5:
        if (store_->spec(m.id).home != tier) {
          Status ev = store_->evict(m.id, tier);
          ASSERT_TRUE(ev.is_ok()) << "step " << step << ": " << ev.to_string();
        }
        break;
      case 6:
        if (rng() % 4 == 0) {
          ASSERT_TRUE(store_->flush(m.id).is_ok());
        }
        store_->set_next_use(m.id, rng() % 1000);
        break;
    }
    ASSERT_LE(ledger_.usage(Tier::kDevice).peak, setup_.device_budget) << "step " << step;
    ASSERT_LE(ledger_.usage(Tier::kHost).peak, setup_.host_budget) << "step " << step;
  }
  ASSERT_TRUE(store_->flush_all().is_ok());
  for (auto& m : model) {
    Residency r = store_->residency(m.id);
    EXPECT_TRUE(r.valid[static_cast<int>(store_->spec(m.id).home)]);
    expect(m.id, Tier::kHost, m.seed);
  }
  EXPECT_GT(store_->stats().evictions, 0u);
  for (auto& m : model) ASSERT_TRUE(store_->destroy_tensor(m.id).is_ok());
  // Nothing leaks: no device bytes, no host bytes in use, no NVMe extents.
  EXPECT_EQ(device_->bytes_in_use(), 0u);
  EXPECT_EQ(ledger_.usage(Tier::kNvme).current, 0u);
  EXPECT_EQ(swap_->stats().extents, 0u);
  PinnedPoolStats ps = pool_->stats();
  EXPECT_EQ(ps.bytes_in_use, 4u * setup_.staging * 3 / 2);  // only the 3 lanes' staging pairs
}

TEST_F(StoreTest, ConcurrentAcquireAndReleaseOfOverlappingTensors) {
  build({.device_budget = 6 << 20, .host_budget = 32 << 20});
  constexpr int kTensors = 12, kThreads = 4;
  std::vector<TensorId> ids;
  for (int i = 0; i < kTensors; ++i) {
    ids.push_back(make("shared" + std::to_string(i), (1 << 20) + i * 4096,
                       i % 2 ? Tier::kNvme : Tier::kHost));
    write(ids.back(), Tier::kHost, 1000 + i);
  }
  // Each thread owns (writes) the tensors with index % kThreads == its number and reads all.
  std::vector<std::vector<uint64_t>> seeds(kTensors);
  std::vector<std::atomic<uint64_t>> current(kTensors);
  for (int i = 0; i < kTensors; ++i) current[i] = 1000 + i;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int step = 0; step < 300; ++step) {
        int i = static_cast<int>(rng() % kTensors);
        Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
        if (i % kThreads == t && rng() % 3 == 0) {
          auto h = store_->acquire(ids[i], tier);
          if (!h.is_ok()) {
            ++failures;
            continue;
          }
          uint64_t seed = 5000 + t * 1000 + step;
          fill_at(*h, seed);
          h->mark_dirty();
          current[i] = seed;
        } else if (i % kThreads == t) {
          auto h = store_->acquire(ids[i], tier);
          if (!h.is_ok() || check_at(*h, current[i]) != -1) ++failures;
        } else {
          // Others' tensors may be rewritten concurrently: just hold and release them.
          auto h = store_->acquire(ids[i], tier);
          if (!h.is_ok()) ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int i = 0; i < kTensors; ++i) expect(ids[i], Tier::kHost, current[i]);
  expect_within_budgets();
}

}  // namespace
}  // namespace zinf
