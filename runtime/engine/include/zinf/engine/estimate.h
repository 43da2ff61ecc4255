// `zinf estimate`: for a model given by its units' sizes, what every ZeRO stage and offload
// choice needs in memory and moves per step, which choices fit given memories, and which to use.
//
// zinf's numbers are zinf's own allocations, computed by the code the engine sizes its budgets
// with (state_sizes.h, budgets.h), so they track what `zinf train` reports (tests/gpt holds them
// to it within 10%):
//   device  the state homed there; the unit being worked on (its gradient buffer in the working
//           dtype, the reduced shard in flight, at stage 3 the shard being gathered); at stage 3
//           the gathered units (the live window: everything when it fits, as the scheduler keeps
//           units used again, else what fits beside the rest);
//   host    the state homed there; when the CPU runs the optimizer, host copies of the
//           parameters it updates (kept while the host budget allows; two of the largest at
//           least); with NVMe the staging buffers and the cache of NVMe-homed state, up to the
//           host budget; at least the pinned buffers the initialisation leaves in the pool;
//   nvme    the state homed there.
// Traffic per rank per step, as zinf's step moves it when nothing is cached: collectives as the
// ZeRO paper counts them (2P stages 0-2, 3P stage 3, in the working dtype), PCIe (gradients to the
// CPU optimizer and updated parameters back; parameter shards from host or NVMe for each use),
// NVMe (optimizer state and the fp32 gradient accumulator read and written once, parameter shards
// read per use, once more as the fp32 master, and written once).
//
// DeepSpeed's own estimators (estimate_zero2/3_model_states_mem_needs_all_cold) are reproduced
// as DeepSpeed computes them, for comparison (deepspeed_zero2_rows, deepspeed_zero3_rows).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/engine/budgets.h"
#include "zinf/engine/engine.h"

namespace zinf {

struct Hardware {
  int gpus_per_node = 1;  // ranks per node
  int nodes = 1;
  // Memories to check against; 0 = not checked.
  uint64_t gpu_mem = 0;  // per device
  uint64_t cpu_mem = 0;  // host memory per node
  uint64_t nvme = 0;     // NVMe space per node
};

struct Placement {
  int stage = 0;
  Tier param_home = Tier::kDevice;
  Tier optimizer_home = Tier::kDevice;
  bool operator==(const Placement&) const = default;
};

struct EstimateRow {
  Placement placement;
  // Memory: peak per device (rank) and per node (all its ranks); *_min is the least budget that
  // runs (one unit gathered at a time, no NVMe cache).
  uint64_t device_bytes = 0;
  uint64_t device_min_bytes = 0;
  uint64_t host_bytes = 0;  // per node
  uint64_t host_min_bytes = 0;
  uint64_t nvme_bytes = 0;            // per node
  uint64_t live_window_elements = 0;  // stage 3: parameter elements gathered at once
  // Traffic per rank per step.
  uint64_t collective_bytes = 0;
  uint64_t pcie_bytes = 0;
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  bool fits = true;
  std::string why_not;  // which memory is short, by how much
};

struct Estimate {
  uint64_t parameters = 0;     // sum of the units' elements
  uint64_t largest_unit = 0;   // elements
  uint64_t padded_params = 0;  // P of the ZeRO arithmetic (units padded to whole shards)
  int ranks = 1;
  std::vector<EstimateRow> rows;  // every placement zinf runs, stage by stage
  int recommended = -1;           // index into rows; -1 when nothing fits
  std::string reason;             // why that one (or why none)
};

// Every stage and offload choice for a model of `unit_elements` (its units, in forward order),
// with `base`'s dtype, scheduler, staging and offload-cache settings (its placement and its
// budgets are ignored; explicit budgets are not). Automatic budgets are chosen as `zinf train`
// chooses them on a node with `machine`'s memory. The recommendation is the choice that fits and
// moves the fewest bytes per step over the slowest link: NVMe, then PCIe, then the network;
// ties go to the lower stage.
// Staging buffers in flight per move, as a config's offload blocks set them (buffer_count): the
// parameter block's when parameters are offloaded, else the optimizer block's.
struct StagingBuffers {
  uint32_t param = static_cast<uint32_t>(tunables::kParamBufferCount.value);
  uint32_t optimizer = tunables::kStagingBuffers.value;
};

Result<Estimate> estimate(const std::vector<uint64_t>& unit_elements, const EngineSettings& base,
                          const Hardware& hardware, const MachineMemory& machine,
                          const StagingBuffers& buffers = {});

// The config fragment that selects `p` (zero_optimization stage and offload blocks, the
// precision block), as `zinf train --config` reads it. `nvme_path` fills nvme_path when some
// state is on NVMe.
nlohmann::ordered_json config_fragment(const Placement& p, DType dtype,
                                       const std::string& nvme_path);

// "stage 3, parameters on nvme, optimizer on cpu".
std::string placement_name(const Placement& p);

// DeepSpeed's estimators, as DeepSpeed computes them (mixed precision, Adam; the
// additional_buffer_factor scales the CPU side). One row per option set, in DeepSpeed's order.
struct DeepSpeedRow {
  uint64_t cpu_bytes = 0;  // per node
  uint64_t gpu_bytes = 0;  // per GPU
  std::string options;     // "offload_param=cpu , offload_optimizer=cpu , zero_init=1"
};
std::vector<DeepSpeedRow> deepspeed_zero2_rows(double total_params, int gpus_per_node, int nodes,
                                               double buffer_factor);
std::vector<DeepSpeedRow> deepspeed_zero3_rows(double total_params, double largest_layer_params,
                                               int gpus_per_node, int nodes, double buffer_factor);
// The text DeepSpeed prints for those rows (its header, then " 127.45GB |   5.31GB | ...").
std::string deepspeed_report(const std::vector<DeepSpeedRow>& rows, double total_params,
                             double largest_layer_params, int gpus_per_node, int nodes);

}  // namespace zinf
