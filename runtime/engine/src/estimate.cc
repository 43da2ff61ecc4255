#include "zinf/engine/estimate.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "stage_policy.h"
#include "state_sizes.h"
#include "zinf/core/state_bytes.h"
#include "zinf/core/units.h"

namespace zinf {

namespace {

using engine_detail::StagePolicy;

std::string_view offload_name(Tier t) {
  return t == Tier::kNvme ? "nvme" : t == Tier::kHost ? "cpu" : "none";
}

// The placements zinf runs: stage 0 on the device; stages 1-2 with the optimizer on the device,
// the CPU or NVMe; stage 3 with parameters no further from the device than the optimizer state.
std::vector<Placement> placements() {
  const Tier tiers[] = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  std::vector<Placement> out{{.stage = 0}};
  for (int stage : {1, 2}) {
    for (Tier opt : tiers) out.push_back({.stage = stage, .optimizer_home = opt});
  }
  for (Tier opt : tiers) {
    for (Tier param : tiers) {
      if (param <= opt) {
        out.push_back({.stage = 3, .param_home = param, .optimizer_home = opt});
      }
    }
  }
  return out;
}

std::string bytes(uint64_t b) { return format_bytes(static_cast<double>(b)); }

// The first memory `row` exceeds, or "".
std::string shortfall(const EstimateRow& row, const Hardware& hw) {
  if (hw.gpu_mem > 0 && row.device_min_bytes > hw.gpu_mem) {
    return fmt::format("device needs {} of {}", bytes(row.device_min_bytes), bytes(hw.gpu_mem));
  }
  if (hw.cpu_mem > 0 && row.host_min_bytes > hw.cpu_mem) {
    return fmt::format("host needs {} of {} per node", bytes(row.host_min_bytes),
                       bytes(hw.cpu_mem));
  }
  if (hw.nvme > 0 && row.nvme_bytes > hw.nvme) {
    return fmt::format("NVMe needs {} of {} per node", bytes(row.nvme_bytes), bytes(hw.nvme));
  }
  return "";
}

// One placement's settings, layouts and sizes, as the engine would build them.
struct RowSetup {
  EngineSettings s;
  StagePolicy policy;
  int world = 1;
  std::vector<zero::ShardLayout> layouts;
  StateSizes z;
  Budgets budgets;
  uint64_t owned = 0, rank_params = 0;  // elements of optimizer state and parameters per rank
};

Result<RowSetup> row_setup(const Placement& p, const std::vector<uint64_t>& unit_elements,
                           const EngineSettings& base, const Hardware& hw,
                           const MachineMemory& machine, const StagingBuffers& buffers) {
  RowSetup r{
      .s = base, .policy = StagePolicy::for_stage(p.stage), .world = hw.gpus_per_node * hw.nodes};
  r.s.stage = p.stage;
  r.s.param_home = p.param_home;
  r.s.optimizer_home = p.optimizer_home;
  // As the config reader sets it: the parameter block's buffers when parameters are offloaded.
  r.s.staging_buffers = p.param_home != Tier::kDevice ? buffers.param : buffers.optimizer;
  if (hw.gpu_mem > 0) r.s.device_mem = hw.gpu_mem;
  for (size_t u = 0; u < unit_elements.size(); ++u) {
    zero::UnitSpec spec{
        .name = fmt::format("unit{}", u),
        .params = {{.name = "w", .shape = {static_cast<int64_t>(unit_elements[u])}}}};
    ZINF_ASSIGN_OR_RETURN(zero::ShardLayout l, zero::make_shard_layout(spec, r.world, r.s.dtype));
    r.layouts.push_back(std::move(l));
  }
  const std::vector<Tier> opt_homes = engine_detail::optimizer_homes(r.s, r.layouts);
  r.z = engine_detail::measure_state(r.s, r.policy, r.layouts, opt_homes, r.world);
  r.budgets = choose_budgets(r.s, r.z, machine, hw.gpus_per_node);
  for (const auto& l : r.layouts) {
    r.owned += r.policy.owned_elements(l);
    r.rank_params += r.policy.param_elements(l);
  }
  return r;
}

// Device: the unit being worked on (its gradient buffer; the reduced shard in flight; at stage 3
// with offloaded parameters, the shard being gathered) and, at stage 3, the live window. With one
// rank the shard is the unit, gathered and reduced in place: no shard beside it.
void device_bytes(const RowSetup& r, EstimateRow& row) {
  const Placement& p = row.placement;
  const uint64_t w = dtype_size(r.s.dtype);
  const uint64_t T = r.z.total_unit_elements, L = r.z.largest_unit_elements;
  const uint64_t shard_beside = r.world > 1 ? L / static_cast<uint64_t>(r.world) * w : 0;
  uint64_t working = L * w + (p.stage > 0 ? shard_beside : 0);
  if (p.stage == 3 && p.param_home != Tier::kDevice) working += shard_beside;
  if (r.policy.sharded_params) {
    const uint64_t fit = live_elements_that_fit(r.z, r.s.dtype, r.budgets.device_bytes);
    const uint64_t wanted =
        r.s.max_reuse_distance > 0 ? T : std::min(T, L + r.s.prefetch_bucket_elements);
    row.live_window_elements = std::max(L, std::min({wanted, r.s.max_live_elements, fit}));
  }
  row.device_bytes = r.z.device_home_bytes + working + row.live_window_elements * w;
  row.device_min_bytes = r.z.device_home_bytes + working + (r.policy.sharded_params ? L * w : 0);
}

// Host, per node: homed state; with the CPU optimizer, the host copies of the parameters it
// updates (two of the largest at least; the store keeps them while the budget allows); with NVMe,
// staging and the cache of NVMe-homed state; at least what the initialisation leaves in the
// pinned pool.
void host_bytes(const RowSetup& r, const Hardware& hw, EstimateRow& row) {
  const Placement& p = row.placement;
  const uint64_t w = dtype_size(r.s.dtype);
  const bool opt_off = p.optimizer_home != Tier::kDevice;
  const uint64_t cpu_optimizer_min = r.z.cpu_update_bytes;
  const uint64_t param_copies = opt_off && p.param_home == Tier::kDevice ? r.rank_params * w : 0;
  const uint64_t host_fixed = r.z.host_home_bytes + r.z.staging_bytes;
  const uint64_t room = r.budgets.host_bytes > host_fixed + cpu_optimizer_min
                            ? r.budgets.host_bytes - host_fixed
                            : cpu_optimizer_min;
  uint64_t host_rank = host_fixed + std::min(r.z.nvme_home_bytes + param_copies, room);
  // The initialisation holds a unit's host parameter copy and, in mixed precision, its fp32
  // master beside it; the pool keeps those blocks for each distinct unit size.
  std::vector<std::pair<uint64_t, uint64_t>> sizes;  // (parameter, shard) elements
  for (const auto& l : r.layouts) sizes.emplace_back(r.policy.param_elements(l), l.shard_numel);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const bool mixed = r.s.dtype != DType::kF32;
  uint64_t init_buffers = 0;
  for (const auto& [params, shard] : sizes) {
    init_buffers += align_up(params * w, 4096) + (mixed ? align_up(shard * 4, 4096) : 0);
  }
  host_rank = std::max(host_rank, init_buffers);
  const uint64_t host_min_rank =
      host_fixed + cpu_optimizer_min + (r.z.nvme ? kHostWorkingFloor : 0);
  const auto per_node = static_cast<uint64_t>(hw.gpus_per_node);
  row.host_bytes = host_rank * per_node;
  row.host_min_bytes = host_min_rank * per_node;
  row.nvme_bytes = r.z.nvme_home_bytes * per_node;
}

// Traffic per rank per step.
void traffic(const RowSetup& r, EstimateRow& row) {
  const Placement& p = row.placement;
  const uint64_t w = dtype_size(r.s.dtype);
  const uint64_t T = r.z.total_unit_elements;
  const bool mixed = r.s.dtype != DType::kF32;
  const bool opt_off = p.optimizer_home != Tier::kDevice;
  const bool param_off = p.param_home != Tier::kDevice;
  row.collective_bytes = (r.policy.sharded_params ? 3 : 2) * T * w;
  const uint64_t uses = row.live_window_elements >= T && r.s.max_reuse_distance > 0 ? 1 : 2;
  const uint64_t opt_state = optimizer_state_bytes_per_element(r.s.dtype, Accumulator::kIncluded);
  if (opt_off) row.pcie_bytes += r.owned * w + (param_off ? 0 : r.owned * w);
  if (param_off) row.pcie_bytes += uses * r.rank_params * w;
  if (p.optimizer_home == Tier::kNvme) {
    row.nvme_read_bytes += r.owned * opt_state;
    row.nvme_write_bytes += r.owned * opt_state;
  }
  if (p.param_home == Tier::kNvme) {
    // fp32: the parameters are the optimizer's master too, read once more for the update.
    row.nvme_read_bytes += (uses + (mixed ? 0 : 1)) * r.rank_params * w;
    row.nvme_write_bytes += r.rank_params * w;
  }
}

Result<EstimateRow> estimate_row(const Placement& p, const std::vector<uint64_t>& unit_elements,
                                 const EngineSettings& base, const Hardware& hw,
                                 const MachineMemory& machine, const StagingBuffers& buffers) {
  ZINF_ASSIGN_OR_RETURN(const RowSetup r, row_setup(p, unit_elements, base, hw, machine, buffers));
  EstimateRow row{.placement = p};
  device_bytes(r, row);
  host_bytes(r, hw, row);
  traffic(r, row);
  row.why_not = shortfall(row, hw);
  row.fits = row.why_not.empty();
  return row;
}

// Orders rows by what they move over the slowest link first.
auto cost(const EstimateRow& r) {
  return std::make_tuple(r.nvme_read_bytes + r.nvme_write_bytes, r.pcie_bytes, r.collective_bytes,
                         r.placement.stage);
}

std::string moved(const EstimateRow& r) {
  const uint64_t nvme = r.nvme_read_bytes + r.nvme_write_bytes;
  return fmt::format("{} NVMe, {} PCIe, {} collectives per step", nvme ? bytes(nvme) : "no",
                     r.pcie_bytes ? bytes(r.pcie_bytes) : "no", bytes(r.collective_bytes));
}

// The row that fits and moves the least, and why (or why nothing fits).
void recommend(Estimate& est);

}  // namespace

std::string placement_name(const Placement& p) {
  if (p.stage < 3) {
    return fmt::format(
        "stage {}, optimizer on {}", p.stage,
        p.optimizer_home == Tier::kDevice ? "the device" : offload_name(p.optimizer_home));
  }
  auto where = [](Tier t) {
    return t == Tier::kDevice ? std::string("the device") : std::string(offload_name(t));
  };
  return fmt::format("stage 3, parameters on {}, optimizer on {}", where(p.param_home),
                     where(p.optimizer_home));
}

Result<Estimate> estimate(const std::vector<uint64_t>& unit_elements, const EngineSettings& base,
                          const Hardware& hw, const MachineMemory& machine,
                          const StagingBuffers& buffers) {
  if (unit_elements.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "the model has no units");
  }
  if (hw.gpus_per_node < 1 || hw.nodes < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "gpus per node and nodes must be at least 1 (got {} and {})",
                      hw.gpus_per_node, hw.nodes);
  }
  Estimate est{.ranks = hw.gpus_per_node * hw.nodes};
  for (uint64_t n : unit_elements) {
    if (n == 0) return make_error(ErrorCode::kInvalidArgument, "a unit has no parameters");
    est.parameters += n;
    est.largest_unit = std::max(est.largest_unit, n);
  }
  for (const Placement& p : placements()) {
    ZINF_ASSIGN_OR_RETURN(EstimateRow row,
                          estimate_row(p, unit_elements, base, hw, machine, buffers));
    est.rows.push_back(std::move(row));
  }
  {
    // P of the arithmetic: the units padded to whole shards (the same for every row).
    EngineSettings s = base;
    for (size_t u = 0; u < unit_elements.size(); ++u) {
      zero::UnitSpec spec{
          .name = "u",
          .params = {{.name = "w", .shape = {static_cast<int64_t>(unit_elements[u])}}}};
      ZINF_ASSIGN_OR_RETURN(zero::ShardLayout l, zero::make_shard_layout(spec, est.ranks, s.dtype));
      est.padded_params += l.numel_padded;
    }
  }

  recommend(est);
  return est;
}

namespace {
void recommend(Estimate& est) {
  std::vector<int> order(est.rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return cost(est.rows[a]) < cost(est.rows[b]); });
  std::vector<std::string> faster;  // cheaper choices that do not fit
  for (int i : order) {
    const EstimateRow& r = est.rows[i];
    if (!r.fits) {
      if (faster.size() < 3) {
        faster.push_back(fmt::format("{} ({})", placement_name(r.placement), r.why_not));
      }
      continue;
    }
    est.recommended = i;
    est.reason = fmt::format("it fits and moves the least: {}", moved(r));
    if (!faster.empty()) {
      est.reason += "; what would move less does not fit: ";
      for (size_t k = 0; k < faster.size(); ++k) est.reason += (k ? "; " : "") + faster[k];
    }
    break;
  }
  if (est.recommended < 0) {
    const auto least =
        std::min_element(est.rows.begin(), est.rows.end(), [](const auto& a, const auto& b) {
          return a.device_min_bytes + a.host_min_bytes < b.device_min_bytes + b.host_min_bytes;
        });
    est.reason = fmt::format("nothing fits; the smallest choice, {}, falls short: {}",
                             placement_name(least->placement), least->why_not);
  }
}
}  // namespace

nlohmann::ordered_json config_fragment(const Placement& p, DType dtype,
                                       const std::string& nvme_path) {
  nlohmann::ordered_json zero = {{"stage", p.stage}};
  auto block = [&](Tier t) {
    nlohmann::ordered_json b = {{"device", offload_name(t)}};
    if (t == Tier::kNvme) b["nvme_path"] = nvme_path;
    return b;
  };
  if (p.param_home != Tier::kDevice) zero["offload_param"] = block(p.param_home);
  if (p.optimizer_home != Tier::kDevice) zero["offload_optimizer"] = block(p.optimizer_home);
  nlohmann::ordered_json j = {{"zero_optimization", zero}};
  if (dtype == DType::kBF16) j["bf16"] = {{"enabled", true}};
  if (dtype == DType::kF16) j["fp16"] = {{"enabled", true}};
  return j;
}

// DeepSpeed's arithmetic (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py), with Python's
// int() truncation where DeepSpeed truncates.
std::vector<DeepSpeedRow> deepspeed_zero2_rows(double total_params, int gpus_per_node, int nodes,
                                               double buffer_factor) {
  const double total_gpus = static_cast<double>(nodes) * gpus_per_node;
  std::vector<DeepSpeedRow> rows;
  for (bool cpu_offload : {true, false}) {
    double cpu = 0, gpu = 0;
    if (cpu_offload) {
      gpu = 2 * total_params;
      cpu = total_params * std::max(4 * total_gpus, 16.0) * buffer_factor;
    } else {
      gpu = 2 * total_params + std::trunc(18 * total_params / total_gpus);
      cpu = total_params * 4 * gpus_per_node * buffer_factor;
    }
    rows.push_back({.cpu_bytes = static_cast<uint64_t>(cpu),
                    .gpu_bytes = static_cast<uint64_t>(gpu),
                    .options = cpu_offload ? "offload_optimizer=cpu " : "offload_optimizer=none"});
  }
  return rows;
}

std::vector<DeepSpeedRow> deepspeed_zero3_rows(double total_params, double largest_layer_params,
                                               int gpus_per_node, int nodes, double buffer_factor) {
  const double total_gpus = static_cast<double>(nodes) * gpus_per_node;
  const double gpus_factor = 1.0 / nodes;
  const double largest_layer_memory = 4 * largest_layer_params;
  std::vector<DeepSpeedRow> rows;
  for (bool cpu_offload : {true, false}) {
    for (bool offload_params : {true, false}) {
      if (!cpu_offload && offload_params) continue;
      for (bool zero_init : {true, false}) {
        double cpu = 0, gpu = 0;
        if (cpu_offload && offload_params) {
          gpu = largest_layer_memory;
          cpu = total_params *
                (zero_init ? 18 * gpus_factor : std::max(4.0 * gpus_per_node, 18 * gpus_factor)) *
                buffer_factor;
        } else if (cpu_offload) {
          gpu = largest_layer_memory + std::trunc(2 * total_params / total_gpus);
          cpu = total_params *
                (zero_init ? 16 * gpus_factor : std::max(4.0 * gpus_per_node, 16 * gpus_factor)) *
                buffer_factor;
        } else {
          gpu = largest_layer_memory + std::trunc(18 * total_params / total_gpus);
          cpu =
              (zero_init ? largest_layer_params : total_params) * 4 * gpus_per_node * buffer_factor;
        }
        rows.push_back(
            {.cpu_bytes = static_cast<uint64_t>(cpu),
             .gpu_bytes = static_cast<uint64_t>(gpu),
             .options = fmt::format("offload_param={}, offload_optimizer={}, zero_init={}",
                                    offload_params ? "cpu " : "none", cpu_offload ? "cpu " : "none",
                                    zero_init ? 1 : 0)});
      }
    }
  }
  return rows;
}

std::string deepspeed_report(const std::vector<DeepSpeedRow>& rows, double total_params,
                             double largest_layer_params, int gpus_per_node, int nodes) {
  std::string out = fmt::format(
      "Estimated memory needed for params, optim states and gradients for a:\n"
      "HW: Setup with {} {}, {} {} per node.\n"
      "SW: Model with {}M total params",
      nodes, nodes > 1 ? "nodes" : "node", gpus_per_node, gpus_per_node > 1 ? "GPUs" : "GPU",
      static_cast<int64_t>(total_params / 1e6));
  if (largest_layer_params > 0) {
    out +=
        fmt::format(", {}M largest layer params", static_cast<int64_t>(largest_layer_params / 1e6));
  }
  out += ".\n  per CPU  |  per GPU |   Options\n";
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  for (const DeepSpeedRow& r : rows) {
    out += fmt::format(" {:7.2f}GB | {:6.2f}GB | {}\n", static_cast<double>(r.cpu_bytes) / kGiB,
                       static_cast<double>(r.gpu_bytes) / kGiB, r.options);
  }
  return out;
}

}  // namespace zinf
