#include "zinf/engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

#include "../io/test_dir.h"
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

// A model computing on the host in the device's own memory (params_in_place, grads_in_place:
// the GPT's CPU model) trains to the same bits as one that copies, at every stage, with
// accumulation, clipping and overlapped reductions (and on the strict device under ctest's
// second run, where any access outside the lent windows faults).
TEST(Engine, InPlaceComputeTrainsToTheSameBitsAsCopies) {
  for (int stage : {0, 1, 2, 3}) {
    EngineSettings s = base(stage);
    s.gradient_accumulation_steps = 2;
    s.gradient_clipping = 0.05f;
    s.overlap_comm = true;
    RunResult copied = train_local(s, 2, 3, 3);
    RunResult in_place = train_local(s, 2, 3, 3, {}, {}, /*in_place=*/true);
    ASSERT_TRUE(copied.status.is_ok()) << copied.status.to_string();
    ASSERT_TRUE(in_place.status.is_ok()) << in_place.status.to_string();
    EXPECT_TRUE(same_bits(copied, in_place)) << "stage " << stage;
  }
}

// The engine lends memory in place only where the model can use it as fp32 on the host: a CPU
// device and fp32; 16-bit runs get nullptr (the model converts through the copies), and a scope
// that has ended is an error.
TEST(Engine, InPlaceIsLentForFp32OnTheCpuDeviceOnly) {
  auto group = comm::make_local_group(1).value();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    EngineSettings s = base(3);
    s.dtype = dt;
    auto engine = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
    UnitScope scope = engine->gather(1).value();
    auto params = scope.params_in_place();
    auto grads = scope.grads_in_place();
    ASSERT_TRUE(params.is_ok()) << params.status().to_string();
    ASSERT_TRUE(grads.is_ok()) << grads.status().to_string();
    EXPECT_EQ(*params != nullptr, dt == DType::kF32) << dtype_name(dt);
    EXPECT_EQ(*grads != nullptr, dt == DType::kF32) << dtype_name(dt);
    if (dt == DType::kF32) {
      std::vector<float> copy(scope.layout().numel);
      ASSERT_TRUE(scope.params_to_host(copy).is_ok());
      EXPECT_EQ(std::memcmp(*params, copy.data(), copy.size() * 4), 0)
          << "the lent parameters are the gathered ones";
      for (uint64_t i = 0; i < scope.layout().numel; ++i) ASSERT_EQ((*grads)[i], 0.0f) << i;
    }
    ASSERT_TRUE(scope.finish().is_ok());
    EXPECT_EQ(scope.params_in_place().status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(scope.grads_in_place().status().code(), ErrorCode::kInvalidArgument);
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

// memory_report() against the ZeRO table in docs/engine.md (fp32; P = padded parameter elements).
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
        if (world == 1) {
          // One rank gathers and reduces in place: no gathered copy (the parameters never pass
          // the table) and no reduced shard, only the gradient buffer.
          buffers = largest;
          EXPECT_EQ(d.peak_by_category[0], params * 4) << "stage " << stage;
        }
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

// One micro-step whose gradients are `value` everywhere, except `poison` (NaN, inf) in the
// middle element of unit `poisoned_unit` (no unit: SIZE_MAX).
Status constant_grads_step(Engine& e, float value, size_t poisoned_unit, float poison) {
  for (size_t u = e.unit_count(); u-- > 0;) {
    ZINF_ASSIGN_OR_RETURN(UnitScope scope, e.gather(u));
    std::vector<float> g(scope.layout().numel, value * e.loss_scale());
    if (u == poisoned_unit) g[g.size() / 2] = poison;
    ZINF_RETURN_IF_ERROR(scope.grads_from_host(g));
    ZINF_RETURN_IF_ERROR(scope.finish());
  }
  return e.step();
}

// Every rank's fp32 master parameters, unit by unit (collective).
std::vector<std::vector<float>> all_params(Engine& e) {
  std::vector<std::vector<float>> out;
  for (size_t u = 0; u < e.unit_count(); ++u) out.push_back(e.full_parameters(u).value());
  return out;
}

bool same_params(const std::vector<std::vector<float>>& a,
                 const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() || std::memcmp(a[u].data(), b[u].data(), a[u].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

// Runs `body(engine, rank)` on `world` local ranks; the first failure.
Status on_ranks(const EngineSettings& s, int world, const std::function<void(Engine&, int)>& body) {
  auto group = comm::make_local_group(world).value();
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto e = Engine::create(s, *group[r], testing::mlp_units({}), testing::mlp_init);
      if (!e.is_ok()) {
        status[r] = e.status();
        return;
      }
      body(**e, r);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& st : status) {
    if (!st.is_ok()) return st;
  }
  return Status::ok();
}

// A skipped step (`infos[0]`, optimizer step `step` not made) and the good step after it
// (`infos[1]`): the skip is counted, the parameters stay bit for bit across it, and the good step
// ends on the bits of a run that never saw the bad one (`clean_end`).
void expect_skipped_without_trace(const std::vector<StepInfo>& infos, int64_t step,
                                  const std::vector<std::vector<float>>& before,
                                  const std::vector<std::vector<float>>& after_skip,
                                  const std::vector<std::vector<float>>& end,
                                  const std::vector<std::vector<float>>& clean_end) {
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_TRUE(infos[0].skipped);
  EXPECT_EQ(infos[0].step, step);
  EXPECT_EQ(infos[0].skipped_steps, 1);
  EXPECT_EQ(infos[0].nonfinite_in_a_row, 1u);
  EXPECT_FALSE(std::isfinite(infos[0].grad_norm));
  EXPECT_TRUE(same_params(before, after_skip)) << "a skipped step changed the parameters";
  EXPECT_FALSE(infos[1].skipped);
  EXPECT_EQ(infos[1].step, step + 1);
  EXPECT_EQ(infos[1].skipped_steps, 1);
  EXPECT_EQ(infos[1].nonfinite_in_a_row, 0u);
  EXPECT_FALSE(same_params(after_skip, end)) << "the comparison is not vacuous";
  EXPECT_TRUE(same_params(clean_end, end)) << "the skipped step left no trace";
}

// fp32 and bf16 (not only fp16) skip a step whose gradient norm is NaN or infinite: the skip is
// counted, the parameters (and the optimizer state: the next good step matches a run that never
// saw the bad one) stay bit for bit, whichever rank held the bad value.
TEST(Engine, NonFiniteGradientsAreSkippedInEveryPrecision) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int world : {1, 2}) {
      for (float poison : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
        SCOPED_TRACE(fmt::format("{} world {} poison {}", dtype_name(dt), world, poison));
        EngineSettings s = base(world == 1 ? 0 : 3);
        s.dtype = dt;
        std::vector<std::vector<float>> clean_end, before, after_skip, end;
        std::vector<StepInfo> infos;
        // The reference: two good steps.
        Status ok = on_ranks(s, world, [&](Engine& e, int rank) {
          EXPECT_TRUE(constant_grads_step(e, 0.01f, SIZE_MAX, 0).is_ok());
          EXPECT_TRUE(constant_grads_step(e, 0.02f, SIZE_MAX, 0).is_ok());
          auto p = all_params(e);
          if (rank == 0) clean_end = p;
        });
        ASSERT_TRUE(ok.is_ok()) << ok.to_string();
        // A good step, a poisoned one (on the last rank only), the second good step.
        ok = on_ranks(s, world, [&](Engine& e, int rank) {
          EXPECT_TRUE(constant_grads_step(e, 0.01f, SIZE_MAX, 0).is_ok());
          auto p0 = all_params(e);
          Status bad = constant_grads_step(e, 0.5f, rank == world - 1 ? 1 : SIZE_MAX, poison);
          EXPECT_TRUE(bad.is_ok()) << bad.to_string();
          auto p1 = all_params(e);
          const StepInfo skipped = e.last_step();
          EXPECT_TRUE(constant_grads_step(e, 0.02f, SIZE_MAX, 0).is_ok());
          auto p2 = all_params(e);
          if (rank == 0) {
            before = p0;
            after_skip = p1;
            end = p2;
            infos = {skipped, e.last_step()};
          }
        });
        ASSERT_TRUE(ok.is_ok()) << ok.to_string();
        expect_skipped_without_trace(infos, 1, before, after_skip, end, clean_end);
      }
    }
  }
}

// With updates fused into the backward pass (overlap_optimizer, no clipping) a step cannot be
// skipped: a non-finite gradient stops the run on every rank with an error naming the unit, the
// poisoned unit's state is left as it was (nothing non-finite reaches a parameter), and every
// later step() and gather() returns that error instead of training on.
TEST(Engine, FusedUpdatesStopTheRunOnANonFiniteGradient) {
  for (int world : {1, 2}) {
    for (float poison : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE(fmt::format("world {} poison {}", world, poison));
      EngineSettings s = base(world == 1 ? 0 : 3);
      s.gradient_clipping = 0;
      s.overlap_optimizer = true;
      std::vector<Status> bad(world), again(world), gather(world);
      std::vector<char> finite(world, 1);  // not vector<bool>: ranks write their own entries
      Status ok = on_ranks(s, world, [&](Engine& e, int rank) {
        EXPECT_TRUE(constant_grads_step(e, 0.01f, SIZE_MAX, 0).is_ok());
        bad[rank] = constant_grads_step(e, 0.5f, rank == world - 1 ? 1 : SIZE_MAX, poison);
        for (const auto& unit : all_params(e)) {
          for (float x : unit) finite[rank] = finite[rank] && std::isfinite(x);
        }
        again[rank] = e.step();
        auto g = e.gather(0);
        gather[rank] = g.is_ok() ? Status::ok() : g.status();
      });
      ASSERT_TRUE(ok.is_ok()) << ok.to_string();
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(bad[r].code(), ErrorCode::kNonFinite)
            << "rank " << r << ": " << bad[r].to_string();
        EXPECT_EQ(again[r].code(), ErrorCode::kNonFinite) << again[r].to_string();
        EXPECT_EQ(gather[r].code(), ErrorCode::kNonFinite) << gather[r].to_string();
        EXPECT_TRUE(finite[r]) << "rank " << r << ": a non-finite value reached the parameters";
      }
      // The rank that owns the poisoned element after the reduction names the unit; the others
      // say that another rank stopped on it.
      int naming = 0;
      for (int r = 0; r < world; ++r) {
        naming += bad[r].message().find("a non-finite gradient (inf or NaN)") != std::string::npos;
        EXPECT_NE(bad[r].message().find("non-finite gradient"), std::string::npos)
            << bad[r].message();
      }
      EXPECT_EQ(naming, 1);
    }
  }
}

// With one rank, a non-finite gradient met by the step's first fused update (overlap_optimizer;
// the last unit's, the first whose gradients are final: a non-finite loss makes it so) comes
// before anything was updated, so the step is skipped as without overlap_optimizer: counted,
// the parameters and state untouched (the next good step ends on the bits of a run that never
// saw the bad one), the updates after it doing nothing. In memory at stage 0, and at stage 3
// with both on NVMe and the shards left on the device between passes.
TEST(Engine, AFusedStepWhoseFirstUpdateMeetsANonFiniteGradientIsSkipped) {
  zinf::testing::TempDir nvme;
  for (bool on_nvme : {false, true}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (float poison : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
        SCOPED_TRACE(
            fmt::format("{} {} poison {}", on_nvme ? "NVMe" : "memory", dtype_name(dt), poison));
        EngineSettings s = base(on_nvme ? 3 : 0);
        s.dtype = dt;
        s.gradient_clipping = 0;
        s.overlap_optimizer = true;
        if (on_nvme) {
          s.param_home = Tier::kNvme;
          s.optimizer_home = Tier::kNvme;
          s.nvme_paths = {nvme.path()};
        }
        std::vector<std::vector<float>> clean_end, before, after_skip, end;
        std::vector<StepInfo> infos;
        Status ok = on_ranks(s, 1, [&](Engine& e, int) {
          for (float g : {0.01f, 0.03f, 0.02f})
            EXPECT_TRUE(constant_grads_step(e, g, SIZE_MAX, 0).is_ok());
          clean_end = all_params(e);
        });
        ASSERT_TRUE(ok.is_ok()) << ok.to_string();
        ok = on_ranks(s, 1, [&](Engine& e, int) {
          // The first step records the order; the second updates during its backward pass.
          EXPECT_TRUE(constant_grads_step(e, 0.01f, SIZE_MAX, 0).is_ok());
          EXPECT_TRUE(constant_grads_step(e, 0.03f, SIZE_MAX, 0).is_ok());
          before = all_params(e);
          Status bad = constant_grads_step(e, 0.5f, e.unit_count() - 1, poison);
          EXPECT_TRUE(bad.is_ok()) << bad.to_string();
          after_skip = all_params(e);
          infos.push_back(e.last_step());
          EXPECT_TRUE(constant_grads_step(e, 0.02f, SIZE_MAX, 0).is_ok());
          end = all_params(e);
          infos.push_back(e.last_step());
        });
        ASSERT_TRUE(ok.is_ok()) << ok.to_string();
        expect_skipped_without_trace(infos, 2, before, after_skip, end, clean_end);
        ASSERT_EQ(infos.size(), 2u);
        EXPECT_GT(infos[1].units_updated_early, 0u) << "the good step after it is fused again";
      }
    }
  }
}

// max_nonfinite_steps in a row stop the run: step() fails naming the step; a good step in
// between resets the count. fp16 with dynamic scaling counts only once the scale is at its
// minimum (the halvings before are how it recovers from an overflow).
TEST(Engine, NonFiniteStepsInARowStopTheRunNamingTheStep) {
  struct Case {
    DType dtype;
    int calls_before_error;  // step() calls that succeed (skipped) before the failing one
  };
  // fp16: scale 2^3 -> 4 -> 2 -> 1 (three uncounted skips), then 3 counted at the minimum.
  for (Case c : {Case{DType::kF32, 2}, Case{DType::kBF16, 2}, Case{DType::kF16, 5}}) {
    SCOPED_TRACE(dtype_name(c.dtype));
    EngineSettings s = base(2);
    s.dtype = c.dtype;
    s.max_nonfinite_steps = 3;
    s.initial_scale_power = 3;
    s.hysteresis = 1;
    s.min_loss_scale = 1;
    auto group = comm::make_local_group(1).value();
    auto e = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init).value();
    // A good step, then two bad ones and a good one: the count starts again.
    ASSERT_TRUE(constant_grads_step(*e, 0.01f, SIZE_MAX, 0).is_ok());
    auto p = all_params(*e);
    int calls = 1;
    Status st;
    for (int i = 0; i < 2; ++i, ++calls) {
      st = constant_grads_step(*e, 0.01f, 0, std::nanf(""));
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
    if (c.dtype != DType::kF16) {
      ASSERT_TRUE(constant_grads_step(*e, 0.01f, SIZE_MAX, 0).is_ok());
      ++calls;
      EXPECT_EQ(e->last_step().nonfinite_in_a_row, 0u);
      EXPECT_EQ(e->last_step().skipped_steps, 2);
      p = all_params(*e);
    } else {
      // Keep the scale's path simple: no good step in between for fp16.
      c.calls_before_error -= 2;
    }
    const int64_t steps_before = e->last_step().step;
    for (int i = 0; i < c.calls_before_error; ++i, ++calls) {
      st = constant_grads_step(*e, 0.01f, 0, std::nanf(""));
      ASSERT_TRUE(st.is_ok()) << "call " << calls + 1 << ": " << st.to_string();
    }
    st = constant_grads_step(*e, 0.01f, 0, std::nanf(""));
    ++calls;
    ASSERT_FALSE(st.is_ok()) << "no error after max_nonfinite_steps in a row";
    EXPECT_EQ(st.code(), ErrorCode::kNonFinite);
    EXPECT_NE(st.message().find(fmt::format("step {}:", calls)), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("NaN in 3 steps in a row"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(fmt::format("optimizer step {}", steps_before)), std::string::npos)
        << st.message();
    EXPECT_TRUE(same_params(p, all_params(*e))) << "no skipped step changed the parameters";
    if (c.dtype == DType::kF16) {
      EXPECT_EQ(e->loss_scale(), 1.0f);
    }
  }
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

// The learning rate and betas set between steps are the ones the next step runs with: a run
// whose settings say one lr and that sets another before each step equals, bit for bit, a run
// whose settings say the other; lr 0 leaves the parameters as they were; a different lr shows.
TEST(Engine, SetLrAndSetBetasApplyToTheNextStep) {
  for (int stage : {0, 3}) {
    SCOPED_TRACE(fmt::format("stage {}", stage));
    const int world = 2;
    // Per step: the lr (and beta1) to set before it, or none.
    auto run = [&](EngineSettings s, const std::vector<float>& lrs, float beta1) {
      std::vector<std::vector<std::vector<float>>> after(lrs.size() + 1);
      Status st = on_ranks(s, world, [&](Engine& e, int rank) {
        if (rank == 0)
          after[0] = all_params(e);
        else
          all_params(e);
        for (size_t k = 0; k < lrs.size(); ++k) {
          if (lrs[k] >= 0) {
            ASSERT_TRUE(e.set_lr(lrs[k]).is_ok());
          }
          if (beta1 >= 0) {
            ASSERT_TRUE(e.set_betas(beta1, 0.99f).is_ok());
          }
          ASSERT_TRUE(constant_grads_step(e, 0.25f * (k + 1), SIZE_MAX, 0).is_ok());
          auto p = all_params(e);
          if (rank == 0) after[k + 1] = std::move(p);
        }
        if (rank == 0 && !lrs.empty() && lrs.back() >= 0) {
          EXPECT_EQ(e.settings().adam.lr, lrs.back());
        }
      });
      EXPECT_TRUE(st.is_ok()) << st.to_string();
      return after;
    };
    EngineSettings plain = base(stage);
    plain.adam.lr = 0.02f;
    plain.adam.beta1 = 0.8f;
    plain.adam.beta2 = 0.99f;
    const auto reference = run(plain, {-1, -1, -1}, -1);
    EngineSettings other = base(stage);
    other.adam.lr = 0.5f;
    const auto set = run(other, {0.02f, 0.02f, 0.02f}, 0.8f);
    for (size_t k = 0; k < reference.size(); ++k) {
      EXPECT_TRUE(same_params(reference[k], set[k])) << "after step " << k;
    }
    const auto paused = run(plain, {0.02f, 0.0f, 0.02f}, -1);
    EXPECT_TRUE(same_params(paused[1], paused[2])) << "lr 0: the parameters stay";
    EXPECT_FALSE(same_params(paused[2], paused[3]));
    EXPECT_FALSE(same_params(reference[2], paused[2])) << "the comparison sees the lr";
  }
}

TEST(Engine, SetLrRefusesBadValuesAndUpdatesAlreadyStarted) {
  EngineSettings s = base(3);
  s.overlap_optimizer = true;  // no clipping, fp32: units are updated during the backward pass
  Status st = on_ranks(s, 1, [&](Engine& e, int) {
    EXPECT_NE(e.set_lr(-1).message().find("set_lr: expected a finite"), std::string::npos);
    EXPECT_FALSE(e.set_lr(std::nanf("")).is_ok());
    EXPECT_FALSE(e.set_lr(std::numeric_limits<float>::infinity()).is_ok());
    EXPECT_NE(e.set_betas(1.0f, 0.9f).message().find("set_betas: expected"), std::string::npos);
    EXPECT_EQ(e.settings().adam.lr, 0.01f) << "a refused value changes nothing";
    ASSERT_TRUE(constant_grads_step(e, 0.5f, SIZE_MAX, 0).is_ok());  // records the order
    for (size_t u = e.unit_count(); u-- > 0;) {  // the second step's backward pass
      auto scope = e.gather(u).value();
      ASSERT_TRUE(scope.grads_from_host(std::vector<float>(scope.layout().numel, 0.5f)).is_ok());
      ASSERT_TRUE(scope.finish().is_ok());
    }
    Status mid = e.set_lr(0.5f);
    EXPECT_NE(mid.message().find("already started"), std::string::npos);
    EXPECT_FALSE(e.set_betas(0.5f, 0.5f).is_ok());
    ASSERT_TRUE(e.step().is_ok());
    EXPECT_GT(e.last_step().units_updated_early, 0u);
    EXPECT_TRUE(e.set_lr(0.5f).is_ok()) << "between steps";
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// Walking the device budget from below one unit's working set up to room for everything: a
// budget the engine accepts trains (reductions in flight give their buffers back before the next
// gradient buffer is taken, and one whose accumulator cannot be had then waits, queued, for a
// later point) and ends on the bits of the unbounded run; one it refuses is refused at creation,
// with the least it needs. Stage 3 with overlap_comm and two micro-steps, so that accumulators
// are both overwritten and read while reductions are in flight.
TEST(Engine, EveryDeviceBudgetTheEngineAcceptsTrainsToTheSameBits) {
  const testing::MlpShape shape{.dims = {64, 256, 256, 256, 256, 256, 8}};
  EngineSettings s = base(3);
  s.overlap_comm = true;
  s.gradient_accumulation_steps = 2;
  s.max_reuse_distance = 0;
  const RunResult ref = train_local(s, 2, 2, 2, shape);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  int refused = 0, trained = 0;
  for (uint64_t kib = 1024; kib <= 6144; kib += 64) {
    s.device_mem = kib << 10;
    const RunResult r = train_local(s, 2, 2, 2, shape);
    if (!r.status.is_ok()) {
      ++refused;
      EXPECT_EQ(trained, 0) << kib << " KiB refused after a smaller budget trained";
      EXPECT_EQ(r.status.code(), ErrorCode::kInvalidArgument) << r.status.to_string();
      EXPECT_NE(r.status.message().find("is too small"), std::string::npos) << r.status.to_string();
      continue;
    }
    ++trained;
    EXPECT_TRUE(same_bits(ref, r)) << kib << " KiB";
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_LE(r.memory[rank].tiers[static_cast<int>(Tier::kDevice)].peak, s.device_mem)
          << kib << " KiB";
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 10);
}

// The same walk over the host budget, with the optimizer (and so the gradient accumulators) on
// NVMe: an accumulator is then a host copy the budget must make room for when a reduction
// completes. Below the floor the run is refused at creation, naming what it needs (the staging
// buffers, then those and two parameter tensors for the CPU update); from the first budget that
// trains, every one trains, within its budget, to the bits of the run with everything on the
// device.
TEST(Engine, EveryHostBudgetTheEngineAcceptsTrainsToTheSameBits) {
  zinf::testing::TempDir nvme;
  const testing::MlpShape shape{.dims = {64, 256, 256, 256, 256, 256, 8}};
  EngineSettings s = base(3);
  s.overlap_comm = true;
  s.gradient_accumulation_steps = 2;
  s.max_reuse_distance = 0;
  const RunResult ref = train_local(s, 2, 2, 2, shape);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  s.optimizer_home = Tier::kNvme;
  s.nvme_paths = {nvme.path()};
  s.staging_bytes = 1 << 20;
  s.staging_buffers = 2;
  int refused = 0, trained = 0;
  for (uint64_t kib = 5120; kib <= 12288; kib += 128) {
    s.host_mem = kib << 10;
    const RunResult r = train_local(s, 2, 2, 2, shape);
    if (!r.status.is_ok()) {
      ++refused;
      EXPECT_EQ(trained, 0) << kib << " KiB refused after a smaller budget trained";
      EXPECT_NE(r.status.message().find("is too small"), std::string::npos) << r.status.to_string();
      continue;
    }
    ++trained;
    EXPECT_TRUE(same_bits(ref, r)) << kib << " KiB";
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_LE(r.memory[rank].tiers[static_cast<int>(Tier::kHost)].peak, s.host_mem)
          << kib << " KiB";
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 10);
}

// With the parameters and the optimizer both homed in host memory the CPU update works on the
// home copies: the host budget needs the homed state and no room for parameter copies beside it.
// The walk steps by less than the two parameter shards a floor counting such copies would add,
// so the first budget accepted is within a step of what the run holds at its peak; it and every
// budget above it train to the bits of the unbounded run.
TEST(Engine, HostHomedStateNeedsNoRoomForParameterCopies) {
  const testing::MlpShape shape{.dims = {64, 256, 256, 256, 256, 256, 8}};
  EngineSettings s = base(3);
  s.param_home = s.optimizer_home = Tier::kHost;
  const RunResult ref = train_local(s, 2, 2, 1, shape);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  constexpr uint64_t kStep = 64 << 10;  // half a 256 x 256 shard of one of two ranks
  int refused = 0, trained = 0;
  for (uint64_t budget = 1 << 20; budget <= (4u << 20); budget += kStep) {
    s.host_mem = budget;
    const RunResult r = train_local(s, 2, 2, 1, shape);
    if (!r.status.is_ok()) {
      ++refused;
      EXPECT_EQ(trained, 0) << budget << " B refused after a smaller budget trained";
      EXPECT_NE(r.status.message().find("is too small"), std::string::npos) << r.status.to_string();
      EXPECT_EQ(r.status.message().find("parameter tensors"), std::string::npos)
          << r.status.to_string();
      continue;
    }
    if (trained++ == 0) {
      EXPECT_LT(budget - kStep, r.memory[0].tiers[static_cast<int>(Tier::kHost)].peak)
          << "the first budget accepted, " << budget << " B, is more than a step above the peak";
    }
    EXPECT_TRUE(same_bits(ref, r)) << budget << " B";
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_LE(r.memory[rank].tiers[static_cast<int>(Tier::kHost)].peak, s.host_mem) << budget;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 10);
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// The global norm adds each piece's block sums of squares, taken when the piece's gradient became
// final (its unit's last reduction of the step, by the recorded trace), so that the norm does not
// read offloaded gradients back. A use the trace did not predict adds to a gradient already
// final: its sums must be taken again. Run X follows the trace of step 0 in step 1, then adds a
// gradient to unit 0 past its predicted last use; run R makes the same step-1 gradients, but its
// step-0 trace already has the extra use of unit 0 (a forward-only gather, which changes
// nothing), so in R that use is predicted and unit 0's sums are taken after it. With clipping
// always on, the norm's every bit reaches the parameters.
TEST(Engine, AGradientAddedAfterItsPredictedLastUseCountsInTheNorm) {
  const testing::MlpShape shape{.dims = {16, 64, 64, 4}};
  auto extra_grads = [](Engine& e) {
    auto scope = e.gather(0);
    ASSERT_TRUE(scope.is_ok()) << scope.status().to_string();
    std::vector<float> g(scope->layout().numel, 0.25f);
    ASSERT_TRUE(scope->grads_from_host(g).is_ok());
    ASSERT_TRUE(scope->finish().is_ok());
  };
  auto departs = [&](Engine& e, int step) {
    if (step == 1) extra_grads(e);
  };
  auto predicted = [&](Engine& e, int step) {
    if (step == 0) {
      ASSERT_TRUE(e.gather(0).is_ok());
    }
    if (step == 1) extra_grads(e);
  };
  for (int stage : {0, 1, 2, 3}) {
    EngineSettings s = base(stage);
    s.gradient_clipping = 1e-3f;  // every step is clipped
    const RunResult x = train_local(s, 2, 2, 2, shape, departs);
    const RunResult r = train_local(s, 2, 2, 2, shape, predicted);
    ASSERT_TRUE(x.status.is_ok() && r.status.is_ok()) << x.status.to_string();
    ASSERT_EQ(x.info.size(), 2u);
    EXPECT_EQ(std::memcmp(&x.info[1].grad_norm, &r.info[1].grad_norm, sizeof(double)), 0)
        << "stage " << stage << ": " << x.info[1].grad_norm << " vs " << r.info[1].grad_norm;
    EXPECT_TRUE(same_bits(x, r)) << "stage " << stage;
    EXPECT_GT(x.schedule[0].departures, 0u) << "stage " << stage;
  }
}

}  // namespace
}  // namespace zinf
