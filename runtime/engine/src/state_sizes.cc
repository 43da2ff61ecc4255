#include "state_sizes.h"

#include <algorithm>

#include "zinf/core/state_bytes.h"

namespace zinf::engine_detail {

uint64_t staging_total_bytes(const EngineSettings& s, bool nvme) {
  if (!nvme) return 0;
  return uint64_t{kStoreMovers + 1} * std::max<uint32_t>(s.staging_buffers, 2) * s.staging_bytes;
}

std::vector<Tier> optimizer_homes(const EngineSettings& s,
                                  const std::vector<zero::ShardLayout>& layouts) {
  uint64_t total_numel = 0, offloaded_numel = 0;
  for (const auto& l : layouts) total_numel += l.numel;
  std::vector<Tier> homes;
  for (const auto& l : layouts) {
    const bool offload = s.optimizer_home != Tier::kDevice &&
                         static_cast<double>(offloaded_numel) + l.numel / 2.0 <=
                             s.optimizer_offload_ratio * static_cast<double>(total_numel);
    if (offload) offloaded_numel += l.numel;
    homes.push_back(offload ? s.optimizer_home : Tier::kDevice);
  }
  return homes;
}

StateSizes measure_state(const EngineSettings& s, const StagePolicy& policy,
                         const std::vector<zero::ShardLayout>& layouts,
                         const std::vector<Tier>& opt_homes, int world) {
  const bool nvme = s.param_home == Tier::kNvme || s.optimizer_home == Tier::kNvme;
  const uint64_t wsize = dtype_size(s.dtype);
  StateSizes z{.staging_bytes = staging_total_bytes(s, nvme),
               .optimizer_offloaded = s.optimizer_home != Tier::kDevice,
               .world = world,
               .nvme = nvme,
               .params_offloaded = s.param_home != Tier::kDevice};
  auto home = [&](Tier tier, uint64_t bytes) {
    if (tier == Tier::kDevice) z.device_home_bytes += bytes;
    if (tier == Tier::kHost) z.host_home_bytes += bytes;
    if (tier == Tier::kNvme) z.nvme_home_bytes += bytes;
  };
  for (size_t u = 0; u < layouts.size(); ++u) {
    const zero::ShardLayout& l = layouts[u];
    z.largest_unit_elements = std::max(z.largest_unit_elements, l.numel_padded);
    z.total_unit_elements += l.numel_padded;
    if (policy.sharded_params && l.numel <= s.param_persistence_threshold) {
      z.persistent_elements += l.numel_padded;
    }
    const uint64_t params = policy.param_elements(l) * wsize;
    home(s.param_home, params);
    if (opt_homes[u] != Tier::kDevice && s.param_home != Tier::kHost) {
      z.cpu_update_bytes = std::max(z.cpu_update_bytes, 2 * params);
    }
    home(opt_homes[u], policy.owned_elements(l) *
                               optimizer_state_bytes_per_element(s.dtype, Accumulator::kExcluded) +
                           policy.accumulator_elements(l) * kAccumulatorBytesPerElement);
  }
  return z;
}

}  // namespace zinf::engine_detail
