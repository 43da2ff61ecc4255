// Budgets that fit the machine: what the engine uses when EngineSettings::device_mem or host_mem
// is 0 (auto). A pure function of the settings, the model's sizes and the machine's memory, so it
// is tested alone.
//
// Every rank computes its own; the engine then takes the smallest over the ranks, so that every
// rank's scheduler makes the same decisions (MemAvailable differs between ranks and over time).
//
// The rule (docs/engine.md, "Budgets"):
//  - shares: the CPU device takes half of MemAvailable, the host tier a quarter, each split
//    evenly across the ranks that share this machine;
//  - with state homed on NVMe the point is to keep RAM small, so device and host together take
//    at most a quarter of MemAvailable per machine (an eighth each) and never more than the
//    configuration asks for:
//      device: at least the state homed there, the persistent units with their gradients and
//              the unit being worked on (its gathered parameters, gradient buffer and two
//              reductions in flight, each with a shard-sized companion; with one rank no
//              companion and no reduction in flight); when parameters are offloaded (stage 3) and
//              it fits the share, the live window on top: max_live_elements of gathered units and
//              their shards;
//      host:   the staging buffers, plus max_in_cpu parameter elements (offload_param.max_in_cpu)
//              of cache, at least kHostWorkingFloor, plus whatever state is homed on the host;
//  - with the optimizer offloaded, the host budget always holds its working set: the staging
//    buffers, two of the largest parameter tensors and kHostWorkingFloor for sub-groups;
//  - state homed in a tier always fits there: a budget is never below the bytes homed in it plus
//    a working margin, even if that exceeds the share (the state has to be somewhere; the
//    budget then says so in its reason).
#pragma once

#include <cstdint>
#include <string>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf {

struct EngineSettings;

struct MachineMemory {
  uint64_t total_bytes = 0;      // MemTotal
  uint64_t available_bytes = 0;  // MemAvailable
  // The GPU's free memory when the device is CUDA (0: the device is the CPU's RAM), and how
  // many of this machine's ranks share that GPU.
  uint64_t device_free_bytes = 0;
  int ranks_per_device = 1;
};
// /proc/meminfo, within the memory cgroup's limit when there is one (memory.max); read once per
// process. An error naming the file when it cannot be read.
Result<MachineMemory> read_machine_memory();

// Ranks sharing this machine's memory: the local communicator's world, else the launcher's
// LOCAL_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE / MPI_LOCALNRANKS / SLURM_NTASKS_PER_NODE, else
// (with a warning) the whole world: budgets too small rather than too large.
int ranks_on_this_machine(bool local_backend, int world_size);

// What the model needs per rank, computed by the engine from its layouts.
struct StateSizes {
  uint64_t largest_unit_elements = 0;  // numel_padded of the largest unit
  uint64_t total_unit_elements = 0;    // sum of numel_padded over units
  // Stage 3: units at or below stage3_param_persistence_threshold stay gathered all run.
  uint64_t persistent_elements = 0;
  uint64_t device_home_bytes = 0;  // state homed on the device (parameters, optimizer)
  uint64_t host_home_bytes = 0;    // state homed in host memory
  uint64_t nvme_home_bytes = 0;    // state homed on NVMe
  uint64_t staging_bytes = 0;      // the store's staging buffers (from the host budget)
  // Host memory the CPU optimizer's update holds beyond the homed state: two parameter tensors
  // (one updated, the next read ahead), the largest of the units whose optimizer is offloaded;
  // none with parameters homed in host memory (the update works on the home copies, counted in
  // host_home_bytes) or with no optimizer offloaded.
  uint64_t cpu_update_bytes = 0;
  bool optimizer_offloaded = false;  // the optimizer runs on the CPU over host copies
  int world = 1;                     // data-parallel ranks (shard = unit / world)
  bool nvme = false;                 // some state is homed on NVMe
  bool params_offloaded = false;     // parameters homed off the device (stage 3)
};

struct Budgets {
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
  std::string device_reason;  // one line each: how the number was chosen
  std::string host_reason;
};

inline constexpr uint64_t kHostWorkingFloor = 32ull << 20;

// Device bytes of the unit being worked on beyond the homed state: its gathered parameters, its
// gradient buffer and `reductions` earlier gradient buffers still being reduced (overlap_comm
// keeps up to two in flight), each with a shard-sized companion (the shard being gathered, the
// reduced shard) when there are several ranks. One rank gathers and reduces in place, and its
// reductions complete at the scope's end (none in flight).
uint64_t device_working_bytes(const StateSizes& sizes, DType dtype, int reductions = 2);
// The least device budget a step runs in with `reductions` in flight: the homed state, the
// persistent units (gathered all run) with their gradient buffers (a model may keep a persistent
// unit's scope open across the others, as a tied embedding does) and the working set.
uint64_t device_minimum_bytes(const StateSizes& sizes, DType dtype, int reductions);
// The most reductions (2, 1 or 0) a step may keep in flight in `device_bytes` (0 without
// overlap_comm or with one rank); -1 when even one unit's working set does not fit. The same on
// every rank (it depends on the agreed budget and the sizes), so the ranks reduce in step.
int reductions_that_fit(const StateSizes& sizes, DType dtype, uint64_t device_bytes,
                        bool overlap_comm);
// The most parameter elements the scheduler may keep gathered (in use, fetched ahead, kept) in a
// device budget: what is left beside the homed state and the working set with `reductions` in
// flight, each gathered element with its share of the shard in flight; never less than the
// largest unit.
uint64_t live_elements_that_fit(const StateSizes& sizes, DType dtype, uint64_t device_bytes,
                                int reductions = 2);

// The budgets for `settings` (explicit ones are kept as given).
Budgets choose_budgets(const EngineSettings& settings, const StateSizes& sizes,
                       const MachineMemory& machine, int ranks_on_machine);

}  // namespace zinf
