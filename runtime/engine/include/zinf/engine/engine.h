// Engine: ZeRO stages 0-3 over one rank's Communicator.
//
// Usage, per rank (each rank is a thread with the local communicator, or a process under MPI):
//
//   auto engine = Engine::create(settings, comm, units, init).value();
//   for (step...) {
//     for (micro-batch in gradient_accumulation_steps) {
//       for (u : forward order) { auto s = engine->gather(u).value(); forward(u, s.params()); }
//       for (u : backward order) {
//         auto s = engine->gather(u).value();
//         backward(u, s.params(), s.grads());   // accumulate (+=) into grads()
//       }                                       // scope end: grads are reduce-scattered
//     }
//     engine->step();
//   }
//
// What each stage holds per rank (P = padded parameter elements, N = world size; fp32):
//   stage 0: full parameters, full gradient accumulator, full Adam m and v        (4P)
//   stage 1: full parameters, full gradient accumulator, m and v of its shard      (2P + 2P/N)
//   stage 2: full parameters, gradient shard, m and v of its shard                 (P + 3P/N)
//   stage 3: parameter shard, gradient shard, m and v of its shard                 (4P/N)
// plus, transiently, the unit being worked on (its gathered parameters in stage 3, its gradient
// buffer while a scope is open and until its reduction has completed).
//
// Equivalence: every stage reduces each micro-step's unit gradients with the communicator's
// rank-order average and accumulates the result in fp32 in micro-step order, computes the
// global gradient norm from per-shard partial sums added in rank order, and runs the same
// elementwise Adam; so all stages give bit-identical parameters for the same world size.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/core/dtype.h"
#include "zinf/core/status.h"
#include "zinf/kernels/adam_math.h"
#include "zinf/memory/accounting.h"
#include "zinf/memory/device.h"
#include "zinf/store/tiered_store.h"
#include "zinf/zero/shard_layout.h"

namespace zinf {

struct EngineSettings {
  int stage = 0;              // ZeRO stage 0..3
  DType dtype = DType::kF32;  // working parameters and gradients
  int gradient_accumulation_steps = 1;
  float gradient_clipping = 0;  // global-norm clipping; 0 = off
  kernels::AdamConfig adam;     // AdamW by default (decoupled weight decay)
  // fp16 dynamic loss scaling (as DeepSpeed): skip the step and lower the scale on overflow.
  float static_loss_scale = 0;  // > 0: a fixed scale; 0: dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  float min_loss_scale = 1;
  uint64_t reduce_bucket_elements = 500'000'000;  // reduce_bucket_size
  bool overlap_comm = false;                      // leave reductions in flight across scopes
  // Placement: where parameters and optimizer state live (the offload work sets these).
  Tier param_home = Tier::kDevice;
  Tier optimizer_home = Tier::kDevice;
  double optimizer_offload_ratio = 1.0;  // share of parameters whose optimizer state is offloaded
  std::vector<std::string> nvme_paths;
  uint64_t device_mem = 0;              // device budget in bytes; 0 = unlimited
  uint64_t host_mem = 0;                // pinned-host budget in bytes; 0 = unlimited
  uint64_t staging_bytes = 2ull << 20;  // NVMe <-> device staging piece (multiple of 1 MiB)
  uint32_t staging_buffers = 4;         // staging pieces in flight per move
  size_t prefetch_units = 2;            // stage 3 offload: units prefetched ahead along the trace
  // Stage 3: units of at most this many parameters stay gathered on the device and are
  // all-gathered once per step instead of at every use (stage3_param_persistence_threshold).
  uint64_t param_persistence_threshold = 0;
  bool checksum = false;             // XXH3 per swapped 1 MiB block, verified on read
  uint32_t io_queue_depth = 32;      // aio.queue_depth
  uint64_t io_block_size = 1 << 20;  // aio.block_size
  uint32_t io_rings = 1;             // aio.intra_op_parallelism
  int optimizer_threads = 0;         // CPU Adam threads; 0 = all
  uint64_t seed = 0;
};

// Initial value of element `element` (index in the unit's flat buffer) of unit `unit`.
using InitFn = std::function<float(size_t unit, uint64_t element, uint64_t seed)>;

class Engine;

// A unit's parameters gathered on the device for the duration of a scope.
class UnitScope {
 public:
  UnitScope() = default;
  UnitScope(UnitScope&& o) noexcept { *this = std::move(o); }
  UnitScope& operator=(UnitScope&& o) noexcept;
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;
  ~UnitScope();

  size_t unit() const { return unit_; }
  const zero::ShardLayout& layout() const;
  // The unit's full flat parameters (working dtype, numel_padded elements).
  void* params() const { return params_; }
  // The unit's full flat gradient buffer (working dtype), zero the first time it is asked for
  // in this scope. Accumulate into it; it is reduced into the owning shards at scope end.
  void* grads();
  // Ends the scope now and reports what failed (the destructor can only record it).
  Status finish();

 private:
  friend class Engine;
  Engine* engine_ = nullptr;
  size_t unit_ = 0;
  void* params_ = nullptr;
  TensorHandle param_handle_;  // stages 0-2: the resident full parameters
  DeviceBuffer gathered_;      // stage 3: the all-gathered full parameters
  DeviceBuffer grads_;
  std::chrono::steady_clock::time_point opened_;  // for the trace
};

struct StepInfo {
  int64_t step = 0;      // optimizer steps taken
  bool skipped = false;  // fp16 overflow: no update this step
  double grad_norm = 0;  // global norm of the (unscaled, averaged) gradients
  float loss_scale = 1;
};

struct MemoryReport {
  TierUsage tiers[kNumTiers];
};

struct CommReport {
  // Elements of the full buffers each rank took part in during the last step (ZeRO volumes).
  uint64_t param_gather_elements = 0;  // all-gathers of parameters
  uint64_t grad_reduce_elements = 0;   // reduce-scatters (P) or all-reduces (2P) of gradients
  uint64_t control_elements = 0;       // norms, overflow flags
  uint64_t volume_elements() const { return param_gather_elements + grad_reduce_elements; }
  comm::CommCounters counters;  // the communicator's counters over the last step
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(const EngineSettings& settings,
                                                comm::Communicator& comm,
                                                std::vector<zero::UnitSpec> units, InitFn init);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Result<UnitScope> gather(size_t unit);
  // Applies the optimizer to the gradients accumulated since the last step.
  Status step();

  // Multiply the loss by this before backward (fp16 loss scaling; 1 otherwise).
  float loss_scale() const;
  const StepInfo& last_step() const { return last_step_; }
  MemoryReport memory_report() const;
  // What the tiered store moved so far (NVMe bytes read and written, evictions, ...).
  StoreStats store_stats() const;
  CommReport comm_report() const { return last_comm_; }
  // Collective: every rank must call it. The unit's fp32 parameters (the master copy), whole.
  Result<std::vector<float>> full_parameters(size_t unit);

  size_t unit_count() const;
  const zero::ShardLayout& layout(size_t unit) const;
  const zero::UnitSpec& unit_spec(size_t unit) const;
  const EngineSettings& settings() const { return settings_; }
  int rank() const;
  int world_size() const;

  struct Impl;

 private:
  friend class UnitScope;
  Engine(const EngineSettings& settings, std::unique_ptr<Impl> impl);
  Status end_scope(UnitScope& scope);
  void* scope_grads(UnitScope& scope);

  EngineSettings settings_;
  std::unique_ptr<Impl> impl_;
  StepInfo last_step_;
  CommReport last_comm_;
};

}  // namespace zinf
