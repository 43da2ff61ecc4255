// `zinf estimate`'s arithmetic (zinf/engine/estimate.h): hand-computed cases, DeepSpeed's
// published estimator examples, the recommendation, and the config fragment read back.
#include "zinf/engine/estimate.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "zinf/engine/settings.h"

namespace zinf {
namespace {

constexpr uint64_t MiB = 1ull << 20, GiB = 1ull << 30;
const MachineMemory kBox{.total_bytes = 24 * GiB, .available_bytes = 23 * GiB};
constexpr uint64_t kUnit = 1ull << 20;  // elements; a whole number of 4 KiB blocks per shard

const EstimateRow& row(const Estimate& e, Placement p) {
  for (const auto& r : e.rows) {
    if (r.placement == p) return r;
  }
  ADD_FAILURE() << "no row for " << placement_name(p);
  return e.rows.front();
}

Estimate four_units(DType dtype, const Hardware& hw = {.gpus_per_node = 2}) {
  EngineSettings s;
  s.dtype = dtype;
  auto e = estimate({kUnit, kUnit, kUnit, kUnit}, s, hw, kBox);
  EXPECT_TRUE(e.is_ok()) << e.status().detail();
  return *e;
}

// Four units of 1 Mi elements, 2 ranks, fp32 (P = 4 Mi, shard 2 Mi per rank).
// The traffic minimum (docs/offload.md), hand-counted per element: 1000 parameter elements on
// NVMe and 1000 elements of optimizer state on NVMe unless a case says otherwise.
TEST(NvmeTrafficMinimum, HandCountedCases) {
  auto min = [](NvmeTrafficInputs in) {
    NvmeTraffic t = nvme_traffic_minimum(in);
    return std::pair<uint64_t, uint64_t>{t.read_bytes, t.written_bytes};
  };
  using P = std::pair<uint64_t, uint64_t>;
  const NvmeTrafficInputs both{.param_elements = 1000, .optimizer_elements = 1000};
  // fp32 without clipping: forward and backward read the parameter (4 + 4), the update reads m
  // and v (8) and writes parameter, m and v (12): ZeRO-Infinity's 16 and 12 bytes per parameter.
  NvmeTrafficInputs in = both;
  in.clipping = false;
  EXPECT_EQ(min(in), (P{16000, 12000}));
  // With clipping the update waits for the norm and reads the fp32 parameter (the master) again.
  EXPECT_EQ(min(both), (P{20000, 12000}));
  // bf16: 2-byte parameters read twice; master, m and v read and written; the parameter written.
  in = both;
  in.dtype = DType::kBF16;
  EXPECT_EQ(min(in), (P{2 * 2000 + 12000, 12000 + 2000}));
  // Two micro-steps: every micro-step gathers each unit twice.
  in.gradient_accumulation_steps = 2;
  in.clipping = false;
  EXPECT_EQ(min(in), (P{4 * 2000 + 12000, 14000}));
  // fp16 is never fused (the overflow check needs every gradient), but its master is not the
  // parameter: no extra read.
  in = both;
  in.dtype = DType::kF16;
  in.clipping = false;
  EXPECT_EQ(min(in), (P{16000, 14000}));
  // The optimizer alone on NVMe (fp32: m and v), and the parameters alone (fp32: the master).
  EXPECT_EQ(min({.optimizer_elements = 1000}), (P{8000, 8000}));
  EXPECT_EQ(min({.param_elements = 1000}), (P{12000, 4000}));
  EXPECT_EQ(min({.param_elements = 1000, .clipping = false}), (P{8000, 4000}));
  EXPECT_EQ(min({}), (P{0, 0}));
  // Persistent units are gathered once per step and kept: their parameters are read once, also
  // over several micro-steps.
  in = both;
  in.clipping = false;
  in.persistent_param_elements = 100;
  EXPECT_EQ(min(in), (P{16000 - 400, 12000}));
  in.gradient_accumulation_steps = 2;
  EXPECT_EQ(min(in), (P{4 * 4 * 900 + 4 * 100 + 8000, 12000}));

  // The host budget: 4000 bytes of accumulators and room for 1500. With clipping every gradient
  // waits for the norm, so 2500 bytes of them wait on NVMe (a write and a read, reported apart
  // from the bytes above); the same with fp16 (the overflow check) and, without those, with two
  // micro-steps (accumulated across them; the second's go straight to the update). With both,
  // they wait twice: after the first micro-step and for the norm. fp32 or bf16 without clipping,
  // one micro-step: each gradient can be taken by its update as it is final, so none has to wait.
  // Room for them all, to the byte: none waits either.
  auto spill = [](NvmeTrafficInputs in) { return nvme_traffic_minimum(in).gradient_spill_bytes; };
  in = both;
  in.accumulator_bytes = 4000;
  in.host_room_bytes = 1500;
  EXPECT_EQ(spill(in), 2500u);
  EXPECT_EQ(min(in), (P{20000, 12000}));  // (the other bytes are unchanged)
  in.update_behind = true;
  EXPECT_EQ(spill(in), 2500u);
  in.clipping = false;
  EXPECT_EQ(spill(in), 0u);
  in.dtype = DType::kBF16;
  EXPECT_EQ(spill(in), 0u);
  in.dtype = DType::kF32;
  in.gradient_accumulation_steps = 2;
  EXPECT_EQ(spill(in), 2500u);
  in.clipping = true;
  EXPECT_EQ(spill(in), 5000u);
  in.gradient_accumulation_steps = 3;
  EXPECT_EQ(spill(in), 7500u);
  in.clipping = false;
  EXPECT_EQ(spill(in), 5000u);
  in.gradient_accumulation_steps = 1;
  in.dtype = DType::kF16;
  EXPECT_EQ(spill(in), 2500u);
  in.host_room_bytes = 4000;
  EXPECT_EQ(spill(in), 0u);
  in.host_room_bytes = 3999;
  EXPECT_EQ(spill(in), 1u);
}

TEST(Estimate, HandComputedFp32) {
  const Estimate e = four_units(DType::kF32);
  EXPECT_EQ(e.parameters, 4 * kUnit);
  EXPECT_EQ(e.padded_params, 4 * kUnit);
  ASSERT_EQ(e.rows.size(), 13u);  // 1 + 3 + 3 + 6 placements
  // Stage 0: params 4P, m and v 8P, accumulator 4P = 64 MiB, plus one unit's gradient (4 MiB).
  EXPECT_EQ(row(e, {.stage = 0}).device_bytes, 68 * MiB);
  // Stage 1: params 16 MiB, m and v of the shard 16 MiB, full accumulator 16 MiB; the gradient
  // and the reduced shard in flight (4 + 2 MiB).
  EXPECT_EQ(row(e, {.stage = 1}).device_bytes, 54 * MiB);
  // Stage 2: the accumulator is a shard too (8 MiB).
  EXPECT_EQ(row(e, {.stage = 2}).device_bytes, 46 * MiB);
  // Stage 2, optimizer on the CPU: the device keeps the parameters and the unit at work; the
  // host holds m, v and the accumulator of the shard (24 MiB per rank) and the host copies of
  // the parameters the CPU updates (16 MiB per rank), per node for 2 ranks.
  const EstimateRow& cpu = row(e, {.stage = 2, .optimizer_home = Tier::kHost});
  EXPECT_EQ(cpu.device_bytes, 22 * MiB);
  EXPECT_EQ(cpu.host_bytes, 2 * (24 + 16) * MiB);
  EXPECT_EQ(cpu.host_min_bytes, 2 * (24 + 2 * 4) * MiB);  // two of the largest parameter tensors
  // Collectives as the ZeRO paper counts them: 2P, and 3P at stage 3 (16 MiB of fp32 each P).
  EXPECT_EQ(row(e, {.stage = 2}).collective_bytes, 32 * MiB);
  // PCIe: the gradient shard down and the updated parameters up (8 MiB each).
  EXPECT_EQ(cpu.pcie_bytes, 16 * MiB);

  // Stage 3, everything on NVMe: 2 ranks x (params 8 MiB + m, v, accumulator 24 MiB).
  const Placement infinity{.stage = 3, .param_home = Tier::kNvme, .optimizer_home = Tier::kNvme};
  const EstimateRow& nvme = row(e, infinity);
  EXPECT_EQ(nvme.nvme_bytes, 64 * MiB);
  EXPECT_EQ(nvme.collective_bytes, 48 * MiB);
  // The window holds every unit (4 Mi elements fit the budget): each shard is read once for
  // the forward and backward passes and once more as the fp32 master; m, v and the accumulator
  // are read and written once; the parameters are written once.
  EXPECT_EQ(nvme.live_window_elements, 4 * kUnit);
  EXPECT_EQ(nvme.nvme_read_bytes, (24 + 8 + 8) * MiB);
  EXPECT_EQ(nvme.nvme_write_bytes, (24 + 8) * MiB);
  // Device: the window (16 MiB), the unit's gradient (4), the reduced shard and the shard being
  // gathered (2 + 2); nothing homed there.
  EXPECT_EQ(nvme.device_bytes, 24 * MiB);
  EXPECT_EQ(nvme.device_min_bytes, 12 * MiB);  // one unit gathered at a time
}

// bf16: 2-byte parameters and gradients, an fp32 master beside m and v.
TEST(Estimate, HandComputedBf16) {
  const Estimate e = four_units(DType::kBF16);
  // Stage 0: params 2P, master, m, v 12P, accumulator 4P = 18P = 72 MiB, plus a unit's gradient.
  EXPECT_EQ(row(e, {.stage = 0}).device_bytes, 72 * MiB + 2 * MiB);
  // Stage 3 on the device: the parameter shard (4 MiB), master, m, v and accumulator of the shard
  // (32 MiB); the window of all four units (8 MiB), the gradient (2) and the reduced shard (1).
  EXPECT_EQ(row(e, {.stage = 3}).device_bytes, (4 + 32 + 8 + 2 + 1) * MiB);
  EXPECT_EQ(row(e, {.stage = 3}).collective_bytes, 3 * 8 * MiB);
}

// A memory the model does not fit in rules rows out, and the recommendation is the fitting row
// that moves the least over the slowest link.
TEST(Estimate, RecommendsTheFastestThatFits) {
  // Everything fits: no offload, and the lowest stage among equals.
  Estimate e = four_units(DType::kF32, {.gpus_per_node = 2, .gpu_mem = 80 * GiB});
  ASSERT_GE(e.recommended, 0);
  EXPECT_EQ(e.rows[e.recommended].placement, (Placement{.stage = 0}));

  // 30 MiB per device: stages 0-3 without offload do not fit (46 MiB at best); the optimizer
  // on the CPU does, and moves no NVMe bytes.
  e = four_units(DType::kF32, {.gpus_per_node = 2, .gpu_mem = 30 * MiB});
  ASSERT_GE(e.recommended, 0);
  const EstimateRow& pick = e.rows[e.recommended];
  EXPECT_EQ(pick.placement.optimizer_home, Tier::kHost);
  EXPECT_EQ(pick.nvme_read_bytes + pick.nvme_write_bytes, 0u);
  EXPECT_LE(pick.device_min_bytes, 30 * MiB);
  EXPECT_FALSE(row(e, {.stage = 2}).fits);
  EXPECT_NE(row(e, {.stage = 2}).why_not.find("device needs"), std::string::npos);
  EXPECT_NE(e.reason.find("does not fit"), std::string::npos) << e.reason;

  // Units of 16 Mi elements (2 x 384 MiB of optimizer state per node at stages 1-3) with 600 MiB
  // of host per node: the CPU rows do not fit, NVMe's (staging, two parameter tensors and the
  // working floor: 184 MiB per rank) do, and stage 1 moves no more than the others.
  auto big = estimate({16 * kUnit, 16 * kUnit, 16 * kUnit, 16 * kUnit}, EngineSettings{},
                      {.gpus_per_node = 2, .gpu_mem = 400 * MiB, .cpu_mem = 600 * MiB}, kBox);
  ASSERT_TRUE(big.is_ok());
  ASSERT_GE(big->recommended, 0) << big->reason;
  EXPECT_EQ(big->rows[big->recommended].placement,
            (Placement{.stage = 1, .optimizer_home = Tier::kNvme}))
      << big->reason;
  EXPECT_FALSE(row(*big, {.stage = 2, .optimizer_home = Tier::kHost}).fits);
  EXPECT_NE(row(*big, {.stage = 2, .optimizer_home = Tier::kHost}).why_not.find("host needs"),
            std::string::npos);

  // Nothing fits 1 MiB: no recommendation, and the reason names the shortfall.
  e = four_units(DType::kF32, {.gpus_per_node = 2, .gpu_mem = 1 * MiB});
  EXPECT_EQ(e.recommended, -1);
  EXPECT_NE(e.reason.find("nothing fits"), std::string::npos) << e.reason;
}

TEST(Estimate, BadInputsAreErrors) {
  EXPECT_FALSE(estimate({}, EngineSettings{}, {}, kBox).is_ok());
  EXPECT_FALSE(estimate({kUnit, 0}, EngineSettings{}, {}, kBox).is_ok());
  EXPECT_FALSE(estimate({kUnit}, EngineSettings{}, {.gpus_per_node = 0}, kBox).is_ok());
}

// The fragment is a config `zinf train --config` reads back to the same placement.
TEST(Estimate, ConfigFragmentRoundTrips) {
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const EstimateRow& r : four_units(dtype).rows) {
      const Placement& p = r.placement;
      const nlohmann::ordered_json j = config_fragment(p, dtype, "/local_nvme");
      auto cfg = config::parse_config_text(j.dump());
      ASSERT_TRUE(cfg.is_ok()) << j.dump() << ": " << cfg.status().detail();
      auto s = settings_from_config(*cfg);
      ASSERT_TRUE(s.is_ok()) << s.status().detail();
      EXPECT_EQ(s->stage, p.stage) << j.dump();
      EXPECT_EQ(s->param_home, p.param_home) << j.dump();
      EXPECT_EQ(s->optimizer_home, p.optimizer_home) << j.dump();
      EXPECT_EQ(s->dtype, dtype) << j.dump();
      const bool nvme = p.param_home == Tier::kNvme || p.optimizer_home == Tier::kNvme;
      EXPECT_EQ(s->nvme_paths,
                nvme ? std::vector<std::string>{"/local_nvme"} : std::vector<std::string>{})
          << j.dump();
    }
  }
}

// DeepSpeed's documentation (docs/code-docs/source/memory.rst): t5-3b, 2851M parameters, 32M in
// the largest layer, 1 node with 8 GPUs, estimate_zero3_model_states_mem_needs_all_cold.
TEST(Estimate, DeepSpeedZero3PublishedExample) {
  const auto rows = deepspeed_zero3_rows(2851e6, 32e6, 8, 1, 1.5);
  EXPECT_EQ(deepspeed_report(rows, 2851e6, 32e6, 8, 1),
            "Estimated memory needed for params, optim states and gradients for a:\n"
            "HW: Setup with 1 node, 8 GPUs per node.\n"
            "SW: Model with 2851M total params, 32M largest layer params.\n"
            "  per CPU  |  per GPU |   Options\n"
            "   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0\n"
            "   63.72GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=0\n"
            "    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
            "  127.45GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=0\n");
}

// The same page's ZeRO-2 example. Its offload row matches DeepSpeed's code today; its
// no-offload row (15.93GB) was printed by an earlier formula (4P + 16P/N) that
// estimate_zero2_model_states_mem_needs has since replaced with 2P + 18P/N (11.28GB), which is
// what DeepSpeed prints now and what zinf reproduces.
TEST(Estimate, DeepSpeedZero2PublishedExample) {
  const auto rows = deepspeed_zero2_rows(2851e6, 8, 1, 1.5);
  EXPECT_EQ(deepspeed_report(rows, 2851e6, 0, 8, 1),
            "Estimated memory needed for params, optim states and gradients for a:\n"
            "HW: Setup with 1 node, 8 GPUs per node.\n"
            "SW: Model with 2851M total params.\n"
            "  per CPU  |  per GPU |   Options\n"
            "  127.45GB |   5.31GB | offload_optimizer=cpu \n"
            "  127.45GB |  11.28GB | offload_optimizer=none\n");
  // The earlier formula's no-offload GPU figure, for the record: 4P + 16P/N.
  EXPECT_NEAR((4 * 2851e6 + 16 * 2851e6 / 8) / double(GiB), 15.93, 0.005);
}

// Two nodes: DeepSpeed's per-node CPU share (gpus_factor = 1/nodes) and total GPU count.
TEST(Estimate, DeepSpeedTwoNodes) {
  const auto z3 = deepspeed_zero3_rows(1e9, 1e8, 4, 2, 1.5);
  // offload both, zero_init: 1e9 * 18 / 2 * 1.5 bytes per node; 4 * 1e8 per GPU.
  EXPECT_EQ(z3[0].cpu_bytes, 13'500'000'000u);
  EXPECT_EQ(z3[0].gpu_bytes, 400'000'000u);
  // No offload: 4 * 1e8 + 18e9 / 8 per GPU.
  EXPECT_EQ(z3[4].gpu_bytes, 400'000'000u + 2'250'000'000u);
  const auto z2 = deepspeed_zero2_rows(1e9, 4, 2, 1.5);
  EXPECT_EQ(z2[0].cpu_bytes, 48'000'000'000u);  // max(4 * 8, 16) * 1.5 per parameter
}

}  // namespace
}  // namespace zinf
