#include "zinf/engine/budgets.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/engine/engine.h"

namespace zinf {

namespace {

Result<MachineMemory> read_meminfo() {
  std::ifstream in("/proc/meminfo");
  if (!in) return make_error(ErrorCode::kIo, "cannot read /proc/meminfo");
  MachineMemory m;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key;
    uint64_t kib = 0;
    fields >> key >> kib;
    if (key == "MemTotal:") m.total_bytes = kib << 10;
    if (key == "MemAvailable:") m.available_bytes = kib << 10;
  }
  if (m.total_bytes == 0 || m.available_bytes == 0) {
    return make_error(ErrorCode::kIo, "/proc/meminfo has no MemTotal or MemAvailable");
  }
  // A memory cgroup (a container) may allow less than the machine has.
  uint64_t limit = 0, used = 0;
  if (std::ifstream max("/sys/fs/cgroup/memory.max"); max >> limit) {
    std::ifstream current("/sys/fs/cgroup/memory.current");
    current >> used;
    m.total_bytes = std::min(m.total_bytes, limit);
    m.available_bytes = std::min(m.available_bytes, limit > used ? limit - used : 0);
  }
  return m;
}

}  // namespace

Result<MachineMemory> read_machine_memory() {
  // Read once per process: the local ranks of one process (threads) see the same numbers.
  static const Result<MachineMemory> once = read_meminfo();
  return once;
}

int ranks_on_this_machine(bool local_backend, int world_size) {
  if (local_backend) return std::max(world_size, 1);
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                           "SLURM_NTASKS_PER_NODE"}) {
    const char* v = std::getenv(name);
    if (v == nullptr) continue;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && n > 0) return static_cast<int>(n);
  }
  // Unknown: assume every rank shares this machine (budgets too small rather than too large).
  log::warn_once("budgets:local-ranks",
                 fmt::format("no launcher variable tells how many ranks share this machine; "
                             "automatic budgets assume all {} do (set LOCAL_WORLD_SIZE)",
                             world_size));
  return std::max(world_size, 1);
}

namespace {

std::string mib(uint64_t bytes) { return format_bytes(static_cast<double>(bytes)); }

// A gathered element with its share of the shard in flight (with one rank the shard is the
// unit, gathered and reduced in place: nothing beside it).
double with_shard(const StateSizes& z) { return z.world > 1 ? 1.0 + 1.0 / z.world : 1.0; }

}  // namespace

uint64_t device_working_bytes(const StateSizes& z, DType dtype, int reductions) {
  // (With one rank a reduction completes at the scope's end: none is in flight.)
  const auto units = static_cast<uint64_t>(2 + (z.world > 1 ? std::clamp(reductions, 0, 2) : 0));
  return static_cast<uint64_t>(
      with_shard(z) * static_cast<double>(units * z.largest_unit_elements * dtype_size(dtype)));
}

uint64_t device_minimum_bytes(const StateSizes& z, DType dtype, int reductions) {
  // The persistent units gathered, and their gradient buffers: a model may hold such a unit's
  // scope open across the others' (a tied embedding, used first and last).
  const auto persistent = static_cast<uint64_t>(
      (with_shard(z) + 1.0) * static_cast<double>(z.persistent_elements * dtype_size(dtype)));
  return z.device_home_bytes + persistent + device_working_bytes(z, dtype, reductions);
}

int reductions_that_fit(const StateSizes& z, DType dtype, uint64_t device_bytes,
                        bool overlap_comm) {
  for (int r = overlap_comm && z.world > 1 ? 2 : 0; r >= 0; --r) {
    if (device_minimum_bytes(z, dtype, r) <= device_bytes) return r;
  }
  return -1;
}

uint64_t live_elements_that_fit(const StateSizes& z, DType dtype, uint64_t device_bytes,
                                int reductions) {
  const uint64_t used = z.device_home_bytes + device_working_bytes(z, dtype, reductions);
  const uint64_t room = device_bytes > used ? device_bytes - used : 0;
  const auto fit = static_cast<uint64_t>(static_cast<double>(room) /
                                         (with_shard(z) * static_cast<double>(dtype_size(dtype))));
  return std::max(fit, z.largest_unit_elements);
}

namespace {

// Device: a GPU's own free memory (three quarters: the model's activations and the math
// libraries' workspaces live beside the engine's state); the CPU device's memory is this
// machine's RAM.
void choose_device_budget(const EngineSettings& s, const StateSizes& z,
                          const MachineMemory& machine, uint64_t ranks, Budgets& b) {
  if (s.device_mem > 0) {
    b.device_bytes = s.device_mem;
    b.device_reason = "set";
    return;
  }
  const bool gpu = machine.device_free_bytes > 0;
  const uint64_t share = gpu ? machine.device_free_bytes / 4 * 3 /
                                   static_cast<uint64_t>(std::max(machine.ranks_per_device, 1))
                             : machine.available_bytes / (z.nvme ? 8 : 2) / ranks;
  // A step's working set beyond the homed state: at least the floor (the persistent units and
  // the unit being worked on, with reductions in flight); at most, on top, the gathered units
  // within the live bound and their shards in flight (the scheduler's live bound is then what
  // fits beside the rest: live_elements_that_fit).
  const uint64_t least = device_minimum_bytes(z, s.dtype, 2);
  const uint64_t most =
      least +
      static_cast<uint64_t>(
          with_shard(z) * static_cast<double>(std::min(s.max_live_elements, z.total_unit_elements) *
                                              dtype_size(s.dtype)));
  if (least > share) {
    b.device_bytes = least;
    b.device_reason = fmt::format(
        "the state homed on the device ({}), the persistent units and one unit's working set; "
        "more than the share of {} ({}): offload parameters or optimizer state to use less",
        mib(z.device_home_bytes), gpu ? "the GPU's free memory" : "MemAvailable", mib(share));
  } else if (z.params_offloaded && most <= share) {
    b.device_bytes = most;
    b.device_reason = fmt::format(
        "the live window (stage3_max_live_parameters and 4 of the largest unit) and {} of "
        "state homed on the device",
        mib(z.device_home_bytes));
  } else if (gpu) {
    b.device_bytes = share;
    b.device_reason = fmt::format("3/4 of the GPU's free memory over the {} rank(s) sharing it",
                                  std::max(machine.ranks_per_device, 1));
  } else {
    b.device_bytes = share;
    b.device_reason = fmt::format("{} of MemAvailable over {} rank(s) on this machine",
                                  z.nvme ? "1/8" : "1/2", ranks);
  }
}

// Host: pinned staging and host-homed state, and with NVMe a bounded cache above it.
void choose_host_budget(const EngineSettings& s, const StateSizes& z, const MachineMemory& machine,
                        uint64_t ranks, Budgets& b) {
  if (s.host_mem > 0) {
    b.host_bytes = s.host_mem;
    b.host_reason = "set";
    return;
  }
  const uint64_t share = machine.available_bytes / (z.nvme ? 8 : 4) / ranks;
  const uint64_t floor =
      z.host_home_bytes + z.staging_bytes + kHostWorkingFloor + z.cpu_update_bytes;
  if (z.nvme) {
    const uint64_t cache = std::max(s.param_max_in_cpu * dtype_size(s.dtype), kHostWorkingFloor);
    const uint64_t asked = floor - kHostWorkingFloor + cache;
    b.host_bytes = std::max(std::min(share, asked), floor);
    b.host_reason = asked <= share
                        ? fmt::format(
                              "staging ({}) and offload_param.max_in_cpu of cache ({}), plus {} of "
                              "state homed in host memory",
                              mib(z.staging_bytes), mib(cache), mib(z.host_home_bytes))
                        : fmt::format(
                              "1/8 of MemAvailable over {} rank(s) on this machine (NVMe offload: "
                              "RAM is kept small)",
                              ranks);
    return;
  }
  b.host_bytes = std::max(share, floor);
  b.host_reason = share >= floor
                      ? fmt::format("1/4 of MemAvailable over {} rank(s) on this machine", ranks)
                      : fmt::format(
                            "the state homed in host memory ({}) and staging; more than the "
                            "share of MemAvailable ({}): offload to NVMe to use less",
                            mib(z.host_home_bytes), mib(share));
}

}  // namespace

Budgets choose_budgets(const EngineSettings& s, const StateSizes& z, const MachineMemory& machine,
                       int ranks_on_machine) {
  const uint64_t ranks = static_cast<uint64_t>(std::max(ranks_on_machine, 1));
  Budgets b;
  choose_device_budget(s, z, machine, ranks, b);
  choose_host_budget(s, z, machine, ranks, b);
  return b;
}

}  // namespace zinf
