#include "zinf/memory/accounting.h"

#include "zinf/core/status.h"

namespace zinf {

void Ledger::raise_peak(Counter& c, uint64_t value) {
  uint64_t seen = c.peak.load(std::memory_order_relaxed);
  while (value > seen && !c.peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void Ledger::add(Tier tier, MemoryCategory category, uint64_t bytes) {
  auto t = static_cast<int>(tier);
  auto k = static_cast<int>(category);
  raise_peak(total_[t], total_[t].current.fetch_add(bytes) + bytes);
  raise_peak(by_category_[t][k], by_category_[t][k].current.fetch_add(bytes) + bytes);
}

void Ledger::sub(Tier tier, MemoryCategory category, uint64_t bytes) {
  auto t = static_cast<int>(tier);
  auto k = static_cast<int>(category);
  uint64_t before = by_category_[t][k].current.fetch_sub(bytes);
  ZINF_CHECK(before >= bytes, "{} {} accounting went negative ({} - {})", tier_name(tier),
             category_name(category), before, bytes);
  total_[t].current.fetch_sub(bytes);
}

TierUsage Ledger::usage(Tier tier) const {
  auto t = static_cast<int>(tier);
  TierUsage u;
  u.current = total_[t].current.load();
  u.peak = total_[t].peak.load();
  for (int k = 0; k < kNumCategories; ++k) {
    u.current_by_category[k] = by_category_[t][k].current.load();
    u.peak_by_category[k] = by_category_[t][k].peak.load();
  }
  return u;
}

void Ledger::reset_peaks() {
  for (int t = 0; t < kNumTiers; ++t) {
    total_[t].peak.store(total_[t].current.load());
    for (int k = 0; k < kNumCategories; ++k) {
      by_category_[t][k].peak.store(by_category_[t][k].current.load());
    }
  }
}

}  // namespace zinf
