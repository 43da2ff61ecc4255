// Memory tiers and the accounting that proves the ZeRO arithmetic: current and peak bytes per
// tier, per category, per rank. Every allocation of model state goes through a Ledger, so tests
// and the CLI can hold the numbers against the ZeRO formulas (the table in docs/engine.md).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace zinf {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
constexpr std::string_view tier_name(Tier t) {
  return t == Tier::kDevice ? "device" : t == Tier::kHost ? "host" : "nvme";
}

enum class MemoryCategory : uint8_t {
  kParameters = 0,   // working parameters (full units gathered, or shards)
  kGradients,        // gradient buffers and shards
  kOptimizerStates,  // fp32 master, Adam m and v
  kBuffers,          // staging, buckets, communication scratch
};
inline constexpr int kNumCategories = 4;
constexpr std::string_view category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kParameters:
      return "parameters";
    case MemoryCategory::kGradients:
      return "gradients";
    case MemoryCategory::kOptimizerStates:
      return "optimizer_states";
    case MemoryCategory::kBuffers:
      return "buffers";
  }
  return "?";
}

struct TierUsage {
  uint64_t current = 0;
  uint64_t peak = 0;
  std::array<uint64_t, kNumCategories> current_by_category{};
  std::array<uint64_t, kNumCategories> peak_by_category{};
};

// Thread-safe counters of bytes held per tier and category (one Ledger per rank).
class Ledger {
 public:
  void add(Tier tier, MemoryCategory category, uint64_t bytes);
  void sub(Tier tier, MemoryCategory category, uint64_t bytes);
  TierUsage usage(Tier tier) const;
  // Restarts the peaks from the current values (e.g. at the start of a step).
  void reset_peaks();

 private:
  struct Counter {
    std::atomic<uint64_t> current{0};
    std::atomic<uint64_t> peak{0};
  };
  static void raise_peak(Counter& c, uint64_t value);
  Counter total_[kNumTiers];
  Counter by_category_[kNumTiers][kNumCategories];
};

}  // namespace zinf
