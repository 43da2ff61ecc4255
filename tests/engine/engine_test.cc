#include "zinf/engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "mlp.h"

namespace zinf {
namespace {

using testing::MlpShape;
using testing::RunResult;
using testing::same_bits;
using testing::train_local;

EngineSettings base(int stage) {
  EngineSettings s;
  s.stage = stage;
  s.adam.lr = 0.01f;
  s.adam.weight_decay = 0.01f;
  // The test model's units are all below DeepSpeed's default threshold (1e5); the tests of
  // gathering want them gathered per use (PersistentUnitsAreGatheredOncePerStep tests the rest).
  s.param_persistence_threshold = 0;
  return s;
}

struct Variant {
  const char* name;
  int gas;
  float clip;
  uint64_t bucket;
  bool overlap;
};

// The promise: every stage gives bit-identical fp32 parameters at every world size.
TEST(Engine, StagesAreBitIdenticalAtWorldSizes1To4) {
  const Variant variants[] = {{"plain", 1, 0, 500'000'000, false},
                              {"accumulation+clipping+buckets", 2, 0.05f, 700, true}};
  for (const Variant& v : variants) {
    for (int world : {1, 2, 3, 4}) {
      RunResult reference;
      for (int stage : {0, 1, 2, 3}) {
        EngineSettings s = base(stage);
        s.gradient_accumulation_steps = v.gas;
        s.gradient_clipping = v.clip;
        s.reduce_bucket_elements = v.bucket;
        s.overlap_comm = v.overlap;
        RunResult r = train_local(s, world, 4, 3);
        ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
        ASSERT_EQ(r.losses.size(), 4u);
        EXPECT_LT(r.losses.back(), r.losses.front()) << v.name << " stage " << stage;
        if (v.clip > 0) {
          EXPECT_GT(r.info.front().grad_norm, v.clip);  // clipping is exercised
        }
        if (stage == 0) {
          reference = r;
        } else {
          EXPECT_TRUE(same_bits(reference, r))
              << v.name << ": stage " << stage << " differs from stage 0 at world " << world;
        }
      }
    }
  }
}

// The comparison above is not vacuous: a different learning rate in the last bit is noticed.
TEST(Engine, BitComparisonDetectsTinyDifferences) {
  EngineSettings a = base(2), b = base(2);
  b.adam.lr = std::nextafter(a.adam.lr, 1.0f);
  RunResult ra = train_local(a, 2, 2, 3), rb = train_local(b, 2, 2, 3);
  ASSERT_TRUE(ra.status.is_ok() && rb.status.is_ok());
  ASSERT_EQ(ra.params.size(), rb.params.size());
  ASSERT_FALSE(ra.params.empty());
  EXPECT_FALSE(same_bits(ra, rb));
}

TEST(Engine, MatchesOneRankWithTheWholeBatch) {
  RunResult one = train_local(base(0), 1, 5, 12);
  ASSERT_TRUE(one.status.is_ok()) << one.status.to_string();
  for (int stage : {1, 3}) {
    RunResult four = train_local(base(stage), 4, 5, 3);
    ASSERT_TRUE(four.status.is_ok()) << four.status.to_string();
    // Same global batch, averaged in a different order: equal to within fp32 rounding
    // amplified by a few Adam steps (stated tolerance: 1e-4 absolute on values of order 0.1).
    for (size_t u = 0; u < one.params.size(); ++u) {
      for (size_t i = 0; i < one.params[u].size(); ++i) {
        ASSERT_NEAR(one.params[u][i], four.params[u][i], 1e-4) << "unit " << u << " elem " << i;
      }
    }
  }
}

TEST(Engine, Bf16AndFp16AreBitIdenticalAcrossStages) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    RunResult reference;
    for (int stage : {0, 1, 2, 3}) {
      EngineSettings s = base(stage);
      s.dtype = dt;
      s.gradient_clipping = 1.0f;
      s.initial_scale_power = 8;  // fp16: small enough that no step overflows
      RunResult r = train_local(s, 2, 3, 4);
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      EXPECT_LT(r.losses.back(), r.losses.front());
      if (stage == 0) {
        reference = r;
      } else {
        EXPECT_TRUE(same_bits(reference, r)) << dtype_name(dt) << " stage " << stage;
      }
    }
  }
}

// The device comes from the settings, or from $ZINF_DEVICE (how ctest runs every engine test a
// second time on the strict device).
TEST(Engine, DeviceComesFromTheSettingsOrTheEnvironment) {
  auto group = comm::make_local_group(1).value();
  EngineSettings s;
  s.device = DeviceKind::kCpuStrict;
  auto strict = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
  EXPECT_EQ(strict->device().name(), "cpu-strict");
  s.device = DeviceKind::kAuto;
  auto chosen = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
  const char* env = std::getenv("ZINF_DEVICE");
  EXPECT_EQ(chosen->device().name(), env && *env ? env : "cpu");
}

// Budgets differ between ranks (MemAvailable, or as here explicitly): every rank runs with the
// smallest, so their schedulers decide the same.
TEST(Engine, RanksRunWithTheSmallestOfTheirBudgets) {
  auto group = comm::make_local_group(2).value();
  std::vector<uint64_t> device(2), host(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      EngineSettings s = base(3);
      s.device_mem = (64ull << 20) * (r + 1);
      s.host_mem = (96ull << 20) / (r + 1);
      auto engine = Engine::create(s, *group[r], testing::mlp_units({}), testing::mlp_init);
      ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
      device[r] = (*engine)->settings().device_mem;
      host[r] = (*engine)->budgets().host_bytes;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(device[0], 64ull << 20);
  EXPECT_EQ(device[1], 64ull << 20);
  EXPECT_EQ(host[0], 48ull << 20);
  EXPECT_EQ(host[1], 48ull << 20);
}

// A model that computes on the device enqueues its operations on the engine's stream and ends
// the scope without waiting: the reduction sees what they wrote.
TEST(Engine, AModelsOwnDeviceOperationsFinishBeforeTheReduction) {
  auto group = comm::make_local_group(1).value();
  EngineSettings s = base(2);
  s.gradient_clipping = 1e9f;  // the norm is computed (and reported), nothing is clipped
  auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
  uint64_t numel = 0;
  for (size_t u = 0; u < engine->unit_count(); ++u) {
    UnitScope scope = engine->gather(u).value();
    TensorRef g = scope.grads().value().ref();
    g.numel = scope.layout().numel;
    numel += g.numel;
    // Work already queued on the stream delays the fill: without the scope's end waiting for
    // the stream, the reduction would read the zeros grads() started from.
    engine->stream().enqueue([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return Status::ok();
    });
    engine->device().fill(g, 0.5f, engine->stream());  // no wait
    ASSERT_TRUE(scope.finish().is_ok());
  }
  ASSERT_TRUE(engine->step().is_ok());
  EXPECT_DOUBLE_EQ(engine->last_step().grad_norm, 0.5 * std::sqrt(static_cast<double>(numel)));
}

// The views a model gets are typed: asking for another element type is an error naming both.
TEST(Engine, ViewsAreTypedAndAWrongTypeIsAnError) {
  auto group = comm::make_local_group(1).value();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    EngineSettings s;
    s.dtype = dt;
    s.stage = 3;
    auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
    UnitScope scope = engine->gather(1).value();
    const TensorView params = scope.params();
    EXPECT_EQ(params.dtype(), dt);
    EXPECT_EQ(params.numel(), scope.layout().numel_padded);
    EXPECT_EQ(params.as<float>().is_ok(), dt == DType::kF32);
    EXPECT_EQ(params.as<BFloat16>().is_ok(), dt == DType::kBF16);
    EXPECT_EQ(params.as<const Float16>().is_ok(), dt == DType::kF16);
    auto wrong = dt == DType::kF32 ? params.as<BFloat16>().status() : params.as<float>().status();
    EXPECT_EQ(wrong.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(wrong.message().find("layer1"), std::string::npos) << wrong.message();
    EXPECT_NE(wrong.message().find(std::string(dtype_name(dt))), std::string::npos)
        << wrong.message();
    auto grads = scope.grads();
    ASSERT_TRUE(grads.is_ok());
    EXPECT_EQ(grads->dtype(), dt);
    // The host copy of the parameters is the initialiser's values in the working precision.
    std::vector<float> host(scope.layout().numel);
    ASSERT_TRUE(scope.params_to_host(host).is_ok());
    for (uint64_t i = 0; i < host.size(); ++i) {
      const float v = testing::mlp_init(1, i, 0);
      const float expect = dt == DType::kF32    ? v
                           : dt == DType::kBF16 ? bf16_to_f32(f32_to_bf16(v))
                                                : f16_to_f32(f32_to_f16(v));
      ASSERT_EQ(host[i], expect) << dtype_name(dt) << " element " << i;
    }
    std::vector<float> too_short(3);
    EXPECT_FALSE(scope.params_to_host(too_short).is_ok());
    EXPECT_FALSE(scope.grads_from_host(too_short).is_ok());
  }
}

// memory_report() against DESIGN.md's table (fp32; P = padded parameter elements).
TEST(Engine, MemoryMatchesTheZeroArithmetic) {
  MlpShape shape;
  for (int world : {1, 2, 3, 4}) {
    uint64_t P = 0;
    for (auto& u : testing::mlp_units(shape))
      P += zero::make_shard_layout(u, world, DType::kF32)->numel_padded;
    const uint64_t N = world;
    for (int stage : {0, 1, 2, 3}) {
      RunResult r = train_local(base(stage), world, 1, 2, shape);
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      uint64_t params = stage == 3 ? P / N : P;
      uint64_t grads = stage <= 1 ? P : P / N;
      uint64_t optim = stage == 0 ? 2 * P : 2 * P / N;
      for (int rank = 0; rank < world; ++rank) {
        const TierUsage& d = r.memory[rank].tiers[static_cast<int>(Tier::kDevice)];
        // Between steps nothing transient is held: the resident state is exactly the table.
        EXPECT_EQ(d.current_by_category[0], params * 4) << "stage " << stage << " world " << world;
        EXPECT_EQ(d.current_by_category[1], grads * 4) << "stage " << stage << " world " << world;
        EXPECT_EQ(d.current_by_category[2], optim * 4) << "stage " << stage << " world " << world;
        // Peaks: the table plus the configured buffers (one unit gathered, one gradient buffer
        // and its reduced shard at a time).
        uint64_t largest = 0;
        for (auto& u : testing::mlp_units(shape)) {
          largest = std::max(largest, zero::make_shard_layout(u, world, DType::kF32)->numel_padded);
        }
        uint64_t buffers = (stage == 3 ? largest : 0) + largest + largest / N;
        EXPECT_LE(d.peak, (params + grads + optim + buffers) * 4) << "stage " << stage;
      }
    }
  }
}

TEST(Engine, CommunicationMatchesTheZeroVolumes) {
  MlpShape shape;
  for (int world : {2, 3}) {
    uint64_t P = 0;
    for (auto& u : testing::mlp_units(shape))
      P += zero::make_shard_layout(u, world, DType::kF32)->numel_padded;
    for (int stage : {0, 1, 2, 3}) {
      EngineSettings s = base(stage);
      s.max_reuse_distance = 0;  // the ZeRO volumes: no unit kept gathered between its uses
      RunResult r = train_local(s, world, 2, 2, shape);
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      for (int rank = 0; rank < world; ++rank) {
        const CommReport& c = r.comm[rank];
        EXPECT_EQ(c.volume_elements(), stage == 3 ? 3 * P : 2 * P) << "stage " << stage;
        // The communicator's own count agrees with the engine's.
        uint64_t counted = c.counters.total().volume_elements - c.control_elements;
        EXPECT_EQ(counted, c.volume_elements()) << "stage " << stage;
      }
    }
  }
}

// stage3_param_persistence_threshold: small units stay gathered, all-gathered once per step
// (after the update) instead of at every use; the bits do not change.
TEST(Engine, PersistentUnitsAreGatheredOncePerStep) {
  MlpShape shape;
  const int world = 2;
  uint64_t P = 0;
  for (auto& u : testing::mlp_units(shape)) {
    P += zero::make_shard_layout(u, world, DType::kF32)->numel_padded;
  }
  EngineSettings no_reuse = base(3);
  no_reuse.max_reuse_distance = 0;
  RunResult plain = train_local(no_reuse, world, 3, 2, shape);
  EngineSettings s = no_reuse;
  s.param_persistence_threshold = 1'000'000;  // every unit of the test model
  RunResult persistent = train_local(s, world, 3, 2, shape);
  ASSERT_TRUE(plain.status.is_ok() && persistent.status.is_ok());
  EXPECT_TRUE(same_bits(plain, persistent));
  EXPECT_EQ(plain.comm[0].param_gather_elements, 2 * P);   // forward and backward
  EXPECT_EQ(persistent.comm[0].param_gather_elements, P);  // once per step
}

TEST(Engine, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  EngineSettings s = base(2);
  s.dtype = DType::kF16;
  s.hysteresis = 1;
  s.initial_scale_power = 8;
  std::atomic<float> scale_before = 0;  // written by every rank's thread (TSan found the race)
  RunResult r = train_local(s, 2, 3, 2, {}, [&](Engine& e, int step) {
    if (step == 1) scale_before = e.loss_scale();
  });
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  EXPECT_FALSE(r.info[0].skipped);
  // An overflowing loss scale: 2^30 times gradients of order 1 overflow fp16 gradients.
  EngineSettings big = s;
  big.initial_scale_power = 30;
  RunResult o = train_local(big, 2, 2, 2);
  ASSERT_TRUE(o.status.is_ok()) << o.status.to_string();
  EXPECT_TRUE(o.info[0].skipped);
  EXPECT_EQ(o.info[0].step, 0);
  EXPECT_EQ(o.info[0].loss_scale, std::ldexp(1.0f, 29));
  EXPECT_GT(scale_before.load(), 0);
}

TEST(Engine, BadSettingsAreClearErrors) {
  auto group = comm::make_local_group(1).value();
  EngineSettings s = base(2);
  s.param_home = Tier::kHost;
  auto e = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("stage 3"), std::string::npos);
  s = base(3);
  s.optimizer_home = Tier::kNvme;
  e = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("nvme_path"), std::string::npos);
  s = base(5);
  EXPECT_FALSE(Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).is_ok());
}

}  // namespace
}  // namespace zinf
