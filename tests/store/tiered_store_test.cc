#include "zinf/store/tiered_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "forwarding_device.h"
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

// A device that forwards to another and can hold back the first copy out of a chosen range of
// bytes (on the thread that issues it, before anything is enqueued), so that a test can act
// while the store is in the middle of copying out of a tensor.
class HoldingDevice final : public test::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;

  // The next copy whose source overlaps [data, data + bytes) waits for open().
  void hold_copy_from(const void* data, uint64_t bytes) {
    std::lock_guard lock(mu_);
    hold_begin_ = static_cast<const char*>(data);
    hold_end_ = hold_begin_ + bytes;
  }
  void wait_until_holding() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return holding_; });
  }
  void open() {
    std::lock_guard lock(mu_);
    hold_begin_ = hold_end_ = nullptr;
    holding_ = false;
    opened_ = true;
    cv_.notify_all();
  }

  void copy_async(void* dst, const void* src, uint64_t bytes, Stream& stream) override {
    {
      std::unique_lock lock(mu_);
      const char* from = static_cast<const char*>(src);
      if (from < hold_end_ && from + bytes > hold_begin_) {
        holding_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return opened_; });
      }
    }
    inner_->copy_async(dst, src, bytes, stream);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const char* hold_begin_ = nullptr;
  const char* hold_end_ = nullptr;
  bool holding_ = false;
  bool opened_ = false;
};

struct StoreSetup {
  uint64_t device_budget = 8 << 20;
  uint64_t host_budget = 16 << 20;
  uint64_t staging = 1 << 20;
  bool checksum = true;
  bool holding_device = false;  // the device is wrapped in a HoldingDevice (holding_)
  uint32_t movers = 2;
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
    if (s.holding_device) {
      auto holding = std::make_unique<HoldingDevice>(std::move(device_));
      holding_ = holding.get();
      device_ = std::move(holding);
    }
    pool_ = std::make_unique<PinnedPool>(PinnedPoolOptions{
        .budget_bytes = s.host_budget, .pin = false, .engine = engine_.get(), .ledger = &ledger_});
    auto st = TieredTensorStore::create({.device = device_.get(),
                                         .host = pool_.get(),
                                         .swap = swap_.get(),
                                         .ledger = &ledger_,
                                         .staging_bytes = s.staging,
                                         .staging_buffers = 2,
                                         .movers = s.movers});
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
  // Has `copy_out` make the store copy out of tensor `id`'s copy in `tier` (held back in the
  // device until let go), and meanwhile, on another thread, acquires that copy, writes `seed`
  // into it and marks it dirty. Returns what `landed()` said when that acquire returned: whether
  // the store's copy out had finished by then.
  bool acquire_while_copying_out(TensorId id, Tier tier, uint64_t seed,
                                 const std::function<Status()>& copy_out,
                                 const std::function<bool()>& landed) {
    {
      auto h = store_->acquire(id, tier);
      EXPECT_TRUE(h.is_ok()) << h.status().to_string();
      if (!h.is_ok()) return false;
      holding_->hold_copy_from(h->data(), h->bytes());
    }
    auto copying = std::async(std::launch::async, copy_out);
    holding_->wait_until_holding();
    std::atomic<bool> landed_first{false};
    auto writer = std::async(std::launch::async, [&] {
      auto h = store_->acquire(id, tier);
      EXPECT_TRUE(h.is_ok()) << h.status().to_string();
      if (!h.is_ok()) return;
      landed_first = landed();
      fill_at(*h, seed);
      h->mark_dirty();
    });
    // An acquire that does not wait is done at once; one that waits cannot be done before the
    // copy is let go. Either way the copy is let go after a while, so neither can hang.
    (void)writer.wait_for(std::chrono::milliseconds(500));
    holding_->open();
    writer.get();
    Status s = copying.get();
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return landed_first;
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
  HoldingDevice* holding_ = nullptr;  // device_, when setup_.holding_device
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<TieredTensorStore> store_;
};

// A host budget that cannot hold the staging buffers is refused when the store is made, with
// the arithmetic, not on the first move that needs a buffer.
TEST_F(StoreTest, AHostBudgetBelowTheStagingBuffersIsRefusedWithTheirSize) {
  auto engine = io::IoEngine::create({.queue_depth = 16, .block_size = 512 << 10});
  ASSERT_TRUE(engine.is_ok());
  auto swap =
      io::SwapSpace::create(**engine, {.directories = {dir_.path()}, .file_bytes = 8 << 20});
  ASSERT_TRUE(swap.is_ok());
  auto device = make_device(resolve_device_kind(DeviceKind::kAuto).value(),
                            {.budget_bytes = 64 << 20, .ledger = &ledger_});
  ASSERT_TRUE(device.is_ok());
  for (uint64_t budget : {uint64_t{5} << 20, uint64_t{6} << 20}) {
    PinnedPool pool(PinnedPoolOptions{.budget_bytes = budget, .pin = false, .ledger = &ledger_});
    auto st = TieredTensorStore::create({.device = device->get(),
                                         .host = &pool,
                                         .swap = swap->get(),
                                         .ledger = &ledger_,
                                         .staging_bytes = 1 << 20,
                                         .staging_buffers = 2,
                                         .movers = 2});
    if (budget < (6u << 20)) {
      ASSERT_FALSE(st.is_ok());
      EXPECT_EQ(st.status().code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(st.status().message().find("host budget 5.00 MiB is too small for the NVMe staging "
                                           "buffers: 3 lanes x 2 buffers x 1.00 MiB = 6.00 MiB"),
                std::string::npos)
          << st.status().to_string();
    } else {
      EXPECT_TRUE(st.is_ok()) << st.status().to_string();  // exactly enough
    }
  }
}

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

// A spent gradient accumulator: discard() drops its dirty host copy without writing it to NVMe
// (the saving the engine counts on), the home's older bytes stand for the contents afterwards
// (and still pass their checksums), and a copy in use, or the home, is left alone.
TEST_F(StoreTest, DiscardDropsADirtyCopyWithoutWritingItBack) {
  build();
  TensorId id = make("grad_acc", 2 << 20, Tier::kNvme);
  write(id, Tier::kHost, 3);
  ASSERT_TRUE(store_->flush(id).is_ok());  // NVMe holds 3
  write(id, Tier::kHost, 4);               // the host copy (4) is the only valid one
  const uint64_t written = store_->stats().bytes_nvme_written;
  {
    auto h = store_->acquire(id, Tier::kHost);
    ASSERT_TRUE(h.is_ok());
    ASSERT_TRUE(store_->discard(id, Tier::kHost).is_ok());  // pinned: left as it is
    EXPECT_TRUE(store_->residency(id).valid[1]);
    EXPECT_FALSE(store_->residency(id).valid[2]);
  }
  ASSERT_TRUE(store_->discard(id, Tier::kHost).is_ok());
  Residency r = store_->residency(id);
  EXPECT_FALSE(r.allocated[1]);
  EXPECT_TRUE(r.valid[2]);
  EXPECT_EQ(store_->stats().bytes_nvme_written, written);  // nothing was written
  EXPECT_EQ(store_->stats().discards, 1u);
  expect(id, Tier::kHost, 3);  // the older contents, read back through their checksums
  EXPECT_EQ(store_->discard(id, Tier::kNvme).code(), ErrorCode::kInvalidArgument);
  // A clean copy goes like an eviction (no write either way), and is not counted.
  ASSERT_TRUE(store_->discard(id, Tier::kHost).is_ok());
  EXPECT_FALSE(store_->residency(id).allocated[1]);
  EXPECT_EQ(store_->stats().discards, 1u);
}

// write_back_async (the update behind step() keeping an updated shard for the next pass): the
// home gets the bytes and the copy stays, clean, so that its eviction writes nothing; a copy
// being written by a handle is left alone (nothing written, still dirty).
TEST_F(StoreTest, WriteBackAsyncKeepsACleanCopy) {
  build();
  TensorId id = make("params", 2 << 20, Tier::kNvme);
  write(id, Tier::kHost, 5);  // the host copy (5) is the only valid one
  const uint64_t written = store_->stats().bytes_nvme_written;
  {
    auto h = store_->acquire(id, Tier::kHost);
    ASSERT_TRUE(h.is_ok());
    h->mark_dirty();  // being written: not now
    ASSERT_TRUE(store_->write_back_async(id, Tier::kHost).get().is_ok());
    EXPECT_FALSE(store_->residency(id).valid[2]);
    EXPECT_EQ(store_->stats().bytes_nvme_written, written);
  }
  ASSERT_TRUE(store_->write_back_async(id, Tier::kHost).get().is_ok());
  Residency r = store_->residency(id);
  EXPECT_TRUE(r.valid[1]) << "the copy stays";
  EXPECT_TRUE(r.valid[2]) << "the home has the bytes";
  const uint64_t after = store_->stats().bytes_nvme_written;
  EXPECT_GT(after, written);
  ASSERT_TRUE(store_->evict(id, Tier::kHost).is_ok());
  EXPECT_EQ(store_->stats().bytes_nvme_written, after) << "a clean copy is dropped unwritten";
  expect(id, Tier::kHost, 5);  // read back from NVMe through its checksums
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

// The store copies out of a copy with its lock released (write-backs, moves into other tiers).
// A handle to that copy lets its holder write at once, so acquire() waits for those copies:
// otherwise the write races with the store's read (what TSan reported in the randomized and
// concurrent tests) and the other tier briefly holds, as valid, a mix of old and new bytes.
TEST_F(StoreTest, AcquireWaitsForAWriteBackOutOfTheCopy) {
  build({.holding_device = true});
  TensorId id = make("blocks.1.params", 1 << 20, Tier::kNvme);
  write(id, Tier::kDevice, 11);  // the only valid copy is on the device
  const int nvme = static_cast<int>(Tier::kNvme);
  bool landed = acquire_while_copying_out(
      id, Tier::kDevice, 12, [&] { return store_->flush(id); },
      [&] { return store_->residency(id).valid[nvme]; });
  EXPECT_TRUE(landed) << "acquire() handed out the device copy while it was being written back";
  EXPECT_FALSE(store_->residency(id).valid[nvme]);  // written after the write-back: stale
  expect(id, Tier::kDevice, 12);
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  expect(id, Tier::kHost, 12);  // from the NVMe home
}

TEST_F(StoreTest, AcquireWaitsForAMoveOutOfTheCopy) {
  build({.holding_device = true});
  TensorId id = make("blocks.2.params", 1 << 20, Tier::kNvme);
  write(id, Tier::kHost, 21);  // the only valid copy is on the host
  const int device = static_cast<int>(Tier::kDevice);
  bool landed = acquire_while_copying_out(
      id, Tier::kHost, 22,
      [&] {
        store_->prefetch(id, Tier::kDevice);  // host -> device, on a mover
        return store_->acquire(id, Tier::kDevice).status();
      },
      [&] { return store_->residency(id).valid[device]; });
  EXPECT_TRUE(landed) << "acquire() handed out the host copy while it was being copied out";
  expect(id, Tier::kDevice, 22);
  expect(id, Tier::kHost, 22);
}

// mark_dirty() may come before the writes it announces ("were or will be modified"): until the
// writer releases its handle the bytes may still change, so nothing is copied out of that copy
// meanwhile. Another thread's acquire of another tier waits for the release and gets what was
// written, instead of a copy taken before the write and kept as valid after it.
TEST_F(StoreTest, NothingIsCopiedOutOfACopyWhileItsWriterHoldsIt) {
  build();
  TensorId id = make("blocks.3.params", 1 << 20, Tier::kNvme);
  write(id, Tier::kHost, 31);
  auto w = store_->acquire(id, Tier::kHost);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  w->mark_dirty();  // announced before the write
  auto reader = std::async(std::launch::async, [&] {
    auto h = store_->acquire(id, Tier::kDevice);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    EXPECT_EQ(check_at(*h, 32), -1) << "a copy taken while its source was being written";
  });
  // An acquire that does not wait is done at once; one that waits is done after the release.
  (void)reader.wait_for(std::chrono::milliseconds(500));
  fill_at(*w, 32);
  w->release();
  reader.get();
  expect(id, Tier::kDevice, 32);
  expect(id, Tier::kHost, 32);
  ASSERT_TRUE(store_->flush(id).is_ok());
  ASSERT_TRUE(store_->evict(id, Tier::kDevice).is_ok());
  ASSERT_TRUE(store_->evict(id, Tier::kHost).is_ok());
  expect(id, Tier::kHost, 32);  // from the NVMe home
}

// The wait above would never end if the writer is the thread that waits: an error instead.
TEST_F(StoreTest, AcquiringElsewhereWhatThisThreadIsWritingIsAnError) {
  build();
  TensorId id = make("blocks.4.params", 1 << 20, Tier::kNvme);
  auto w = store_->acquire(id, Tier::kHost, Access::kOverwrite);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  auto d = store_->acquire(id, Tier::kDevice);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("blocks.4.params"), std::string::npos);
  EXPECT_EQ(store_->flush(id).code(), ErrorCode::kInvalidArgument);
  fill_at(*w, 41);
  w->release();
  expect(id, Tier::kDevice, 41);
  ASSERT_TRUE(store_->flush(id).is_ok());
}

// A prefetch is a hint the store acts on later, on a mover: by then the copy it would read may
// be held by a caller who writes it before calling mark_dirty(). It does not read such a copy
// (an acquire that needs the prefetched copy moves it then).
TEST_F(StoreTest, APrefetchDoesNotCopyOutOfACopyInUse) {
  build({.holding_device = true, .movers = 1});
  TensorId other = make("blocks.5.params", 1 << 20, Tier::kHost);
  TensorId id = make("blocks.6.params", 1 << 20, Tier::kNvme);
  write(id, Tier::kDevice, 51);  // the only valid copy is on the device
  {
    auto h = store_->acquire(other, Tier::kHost);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    holding_->hold_copy_from(h->data(), h->bytes());
  }
  store_->prefetch(other, Tier::kDevice);  // the one mover is held in this move
  holding_->wait_until_holding();
  store_->prefetch(id, Tier::kHost);  // device -> host, queued behind it
  {
    auto h = store_->acquire(id, Tier::kDevice);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    holding_->open();
    // Queued after the prefetch on the one mover: once it reports, the prefetch has run.
    ASSERT_TRUE(store_->evict_async(other, Tier::kHost).get().is_ok());
    EXPECT_FALSE(store_->residency(id).valid[static_cast<int>(Tier::kHost)])
        << "a prefetch copied out of a copy held by a caller";
    fill_at(*h, 52);
    h->mark_dirty();
  }
  expect(id, Tier::kHost, 52);
  expect(id, Tier::kDevice, 52);
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

// Waits (at most 10 s) until `done()` holds; whether it did.
bool eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Prefetches are issued in the order of use: one that would evict a copy another prefetch
// brought, not yet used, gives up instead (it would only read that copy twice). An acquire may
// still take such a copy, and once acquired a copy is no longer protected.
TEST_F(StoreTest, APrefetchNeverEvictsACopyAwaitingUse) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  for (int i = 0; i < 4; ++i) store_->prefetch(ids[i], Tier::kDevice);
  ASSERT_TRUE(eventually([&] {
    for (int i = 0; i < 4; ++i) {
      if (!store_->residency(ids[i]).valid[0]) return false;
    }
    return true;
  }));
  store_->prefetch(ids[4], Tier::kDevice);
  ASSERT_TRUE(eventually([&] { return store_->stats().prefetches_given_up == 1; }));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(store_->residency(ids[i]).valid[0]) << i;
  EXPECT_FALSE(store_->residency(ids[4]).allocated[0]);
  expect(ids[4], Tier::kDevice, 0);  // on demand: evicts one of them
  int resident = 0;
  for (int i = 0; i < 4; ++i) resident += store_->residency(ids[i]).valid[0];
  EXPECT_EQ(resident, 3);
  // Used copies go for a prefetch as before (t4 was just used, so the other one).
  for (int i = 0; i < 4; ++i) {
    if (store_->residency(ids[i]).valid[0]) expect(ids[i], Tier::kDevice, 0);
  }
  store_->prefetch(ids[5], Tier::kDevice);
  ASSERT_TRUE(eventually([&] { return store_->residency(ids[5]).valid[0]; }));
  EXPECT_EQ(store_->stats().prefetches_given_up, 1u);
  expect_within_budgets();
}

// keep_for_use: a copy made for a use that comes later (the engine's host copy of a unit's
// parameters kept for its update) is kept like a copy read ahead. Used first, it would be the
// least recently used, the first to go; kept, neither a prefetch nor a demand for room takes it
// while other clean copies are there, and its acquire ends the protection.
TEST_F(StoreTest, ACopyKeptForAUseOutlivesTheOtherCleanCopies) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  write(ids[0], Tier::kHost, 40);
  expect(ids[0], Tier::kDevice, 40);
  store_->keep_for_use(ids[0], Tier::kDevice);
  for (int i = 1; i < 4; ++i) expect(ids[i], Tier::kDevice, 0);  // the budget is full
  store_->prefetch(ids[4], Tier::kDevice);
  ASSERT_TRUE(eventually([&] { return store_->residency(ids[4]).valid[0]; }));
  EXPECT_TRUE(store_->residency(ids[0]).valid[0]);
  EXPECT_FALSE(store_->residency(ids[1]).valid[0]);  // the least recently used of the others
  expect(ids[5], Tier::kDevice, 0);                  // on demand: another used copy goes
  EXPECT_TRUE(store_->residency(ids[0]).valid[0]);
  EXPECT_FALSE(store_->residency(ids[2]).valid[0]);
  EXPECT_EQ(store_->stats().prefetches_given_up, 0u);
  // Its use takes it without a read (no move into the device tier beyond the six above).
  const StoreStats before = store_->stats();
  expect(ids[0], Tier::kDevice, 40);
  EXPECT_EQ(store_->stats().bytes_to_device, before.bytes_to_device);
  // A copy that is not there is left alone.
  store_->keep_for_use(ids[1], Tier::kDevice);
  EXPECT_FALSE(store_->residency(ids[1]).allocated[0]);
  expect_within_budgets();
}

// A copy an acquire waits for lands before that acquire wakes up to take it. The mover that moved
// it may go on with an ordered list, whose next read needs room: the copy just landed is not that
// room. Taken, it would be read twice (in the engine's walk behind step(), the state of the group
// being updated was read again every step).
TEST_F(StoreTest, ACopyLandedForAWaitingAcquireIsNotAPrefetchsRoom) {
  build({.device_budget = 2 << 20, .holding_device = true, .movers = 1});
  TensorId wanted = make("wanted", 1 << 20, Tier::kHost), next = make("next", 1 << 20, Tier::kHost);
  TensorId dirty = make("dirty", 1 << 20, Tier::kHost);
  write(wanted, Tier::kHost, 61);
  write(dirty, Tier::kDevice, 62);  // half the device budget, and a clean-only prefetch's no room
  {
    auto h = store_->acquire(wanted, Tier::kHost);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    holding_->hold_copy_from(h->data(), h->bytes());
  }
  const StoreStats before = store_->stats();
  store_->prefetch_in_order({{wanted, Tier::kDevice}, {next, Tier::kDevice}},
                            PrefetchRoom::kCleanOnly);
  holding_->wait_until_holding();  // the list's mover, in the middle of moving `wanted`
  auto user = std::async(std::launch::async, [&] { expect(wanted, Tier::kDevice, 61); });
  // The acquire joins the move (there is nothing else for it to do): let it.
  (void)user.wait_for(std::chrono::milliseconds(200));
  holding_->open();
  user.get();
  // Queued after the list on the one mover: once it reports, the list has run.
  ASSERT_TRUE(store_->evict_async(wanted, Tier::kHost).get().is_ok());
  EXPECT_EQ(store_->stats().bytes_to_device - before.bytes_to_device, 1u << 20)
      << "the copy the acquire waited for was evicted before it took it, and read again";
  EXPECT_EQ(store_->stats().prefetches_given_up - before.prefetches_given_up, 1u);
  EXPECT_FALSE(store_->residency(next).valid[0]);
  expect(dirty, Tier::kDevice, 62);
  expect_within_budgets();
}

// PrefetchRoom::kCleanOnly: a prefetch that could only make room by writing a dirty copy back
// gives up and writes nothing; kAny writes it back and evicts it, and the data survives.
TEST_F(StoreTest, ACleanOnlyPrefetchWritesNothingBack) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  for (int i = 0; i < 4; ++i) write(ids[i], Tier::kDevice, 10 + i);
  const StoreStats before = store_->stats();
  store_->prefetch(ids[4], Tier::kDevice, PrefetchRoom::kCleanOnly);
  ASSERT_TRUE(eventually([&] { return store_->stats().prefetches_given_up == 1; }));
  EXPECT_EQ(store_->stats().writebacks, before.writebacks);
  EXPECT_EQ(store_->stats().bytes_to_host, before.bytes_to_host);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(store_->residency(ids[i]).valid[0]) << i;
  store_->prefetch(ids[4], Tier::kDevice, PrefetchRoom::kAny);
  ASSERT_TRUE(eventually([&] { return store_->residency(ids[4]).valid[0]; }));
  EXPECT_EQ(store_->stats().writebacks, before.writebacks + 1);
  for (int i = 0; i < 4; ++i) expect(ids[i], Tier::kHost, 10 + i);
  expect_within_budgets();
}

// prefetch_in_order stops at the first copy that does not fit: the smaller ones after it, which
// would fit, are not brought (they would take the room the first needs when its turn comes).
TEST_F(StoreTest, PrefetchInOrderStopsAtTheFirstThatDoesNotFit) {
  build({.device_budget = 4 << 20});
  TensorId held = make("held", 2 << 20, Tier::kHost), big = make("big", 3 << 20, Tier::kHost);
  TensorId s0 = make("s0", 1 << 20, Tier::kHost), s1 = make("s1", 1 << 20, Tier::kHost);
  auto h = store_->acquire(held, Tier::kDevice);  // 2 of the 4 MiB, pinned
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  store_->prefetch_in_order({{big, Tier::kDevice}, {s0, Tier::kDevice}, {s1, Tier::kDevice}},
                            PrefetchRoom::kCleanOnly);
  ASSERT_TRUE(eventually([&] { return store_->stats().prefetches_given_up == 1; }));
  // The list stopped with the lock held from that give-up on: nothing after it was started.
  EXPECT_FALSE(store_->residency(big).allocated[0]);
  EXPECT_FALSE(store_->residency(s0).allocated[0]);
  EXPECT_FALSE(store_->residency(s1).allocated[0]);
  // In order, the ones that fit all come.
  store_->prefetch_in_order({{s0, Tier::kDevice}, {s1, Tier::kDevice}}, PrefetchRoom::kCleanOnly);
  ASSERT_TRUE(
      eventually([&] { return store_->residency(s0).valid[0] && store_->residency(s1).valid[0]; }));
  h->release();
  expect(big, Tier::kDevice, 0);
  expect_within_budgets();
}

// A read ahead still landing is not a copy in use: an allocation that needs its room waits for it
// to land, then evicts it, instead of failing with the budget "exhausted" (without the wait, the
// GPT's device budget walk, tests/gpt/budget_walk_test.cc, fails so on a loaded machine, in the
// gradient buffer of a unit).
TEST_F(StoreTest, AnAllocationWaitsForAReadAheadStillLanding) {
  build({.device_budget = 2 << 20, .holding_device = true});
  const TensorId a = make("a", 1 << 20, Tier::kHost);
  write(a, Tier::kHost, 7);
  auto held = store_->allocate_device(1 << 20, MemoryCategory::kBuffers, "held");
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  {
    auto h = store_->acquire(a, Tier::kHost);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    holding_->hold_copy_from(h->data(), h->bytes());
  }
  store_->prefetch(a, Tier::kDevice);
  holding_->wait_until_holding();  // a's device copy has its storage: the budget is full
  auto second = std::async(std::launch::async, [&] {
    return store_->allocate_device(1 << 20, MemoryCategory::kBuffers, "second");
  });
  // Not before the copy lands, and no failure meanwhile.
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  holding_->open();
  auto got = second.get();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_FALSE(store_->residency(a).valid[static_cast<int>(Tier::kDevice)]);
  held->reset();
  expect(a, Tier::kHost, 7);
  expect_within_budgets();
}

// A prefetch that could not get its room even by evicting everything it may take evicts nothing:
// giving up after dropping copies would lose them for nothing.
TEST_F(StoreTest, APrefetchThatCannotFitEvictsNothing) {
  build({.device_budget = 4 << 20});
  TensorId held = make("held", 2 << 20, Tier::kHost), big = make("big", 3 << 20, Tier::kHost);
  TensorId c0 = make("c0", 1 << 20, Tier::kHost), c1 = make("c1", 1 << 20, Tier::kHost);
  expect(c0, Tier::kDevice, 0);  // used and released: clean copies a prefetch may take
  expect(c1, Tier::kDevice, 0);
  auto h = store_->acquire(held, Tier::kDevice);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  store_->prefetch(big, Tier::kDevice, PrefetchRoom::kCleanOnly);  // 3 MiB: at most 2 to take
  ASSERT_TRUE(eventually([&] { return store_->stats().prefetches_given_up == 1; }));
  EXPECT_TRUE(store_->residency(c0).valid[0]);
  EXPECT_TRUE(store_->residency(c1).valid[0]);
  EXPECT_FALSE(store_->residency(big).allocated[0]);
  h->release();
  expect(big, Tier::kDevice, 0);  // on demand it takes what it needs
  expect_within_budgets();
}

// A copy already in the tier when an ordered list comes to it is kept for its use like one the
// list brought: the list's later copies do not evict it.
TEST_F(StoreTest, PrefetchInOrderKeepsTheCopiesAlreadyThere) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  expect(ids[0], Tier::kDevice, 0);
  expect(ids[1], Tier::kDevice, 0);
  std::vector<std::pair<TensorId, Tier>> list;
  for (TensorId id : ids) list.emplace_back(id, Tier::kDevice);
  store_->prefetch_in_order(std::move(list), PrefetchRoom::kCleanOnly);
  ASSERT_TRUE(eventually([&] { return store_->stats().prefetches_given_up == 1; }));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(store_->residency(ids[i]).valid[0]) << i;
  EXPECT_FALSE(store_->residency(ids[4]).allocated[0]);
  expect_within_budgets();
}

// When an acquire must evict a copy awaiting use, it takes the one read ahead last: read ahead
// in the order of use, it is the one needed last.
TEST_F(StoreTest, AnAcquireEvictsTheCopyReadAheadLast) {
  build({.device_budget = 4 << 20});
  std::vector<TensorId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(make("t" + std::to_string(i), 1 << 20, Tier::kHost));
  std::vector<std::pair<TensorId, Tier>> list;
  for (int i = 0; i < 4; ++i) list.emplace_back(ids[i], Tier::kDevice);
  store_->prefetch_in_order(std::move(list), PrefetchRoom::kCleanOnly);
  ASSERT_TRUE(eventually([&] {
    for (int i = 0; i < 4; ++i) {
      if (!store_->residency(ids[i]).valid[0]) return false;
    }
    return true;
  }));
  expect(ids[4], Tier::kDevice, 0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(store_->residency(ids[i]).valid[0]) << i;
  EXPECT_FALSE(store_->residency(ids[3]).valid[0]);
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
          // Others may be acquiring the tensor meanwhile: the write is announced before it is
          // made, so that nothing is copied out of the copy while it changes.
          h->mark_dirty();
          fill_at(*h, seed);
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
