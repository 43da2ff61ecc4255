// The main job: the GPT trained through the Engine (ZeRO stages 0-3, CPU/NVMe offload), one rank
// per thread on the local communicator or one per process under mpirun.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"
#include "zinf/engine/engine.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/safetensors.h"  // write_safetensors: the export

namespace zinf::gpt {

struct TrainOptions {
  GptConfig model;
  std::string model_name = "custom";  // the preset, for messages
  int batch = 8;                      // sequences per rank per micro-step
  int seq = 0;                        // tokens per sequence; 0 = the model's context
  int steps = 100;
  uint64_t seed = 1;
  std::string data;  // text file; empty = the fortunes corpus
  int ranks = 1;     // local threads (ignored under mpirun)
  bool mpi = false;  // one rank per process (set when launched by mpirun)
  // Bound on every wait for a peer (ZINF_COMM_TIMEOUT, read by the CLI). A rank that fails stops
  // its peers at once (Communicator::abort); this bounds the rest (a rank that hangs).
  std::chrono::milliseconds comm_timeout = comm::kDefaultTimeout;
  EngineSettings engine;    // stage, dtype, optimizer, offload, budgets
  std::string log_json;     // one JSON object per step
  std::string export_path;  // consolidated fp32 weights (.safetensors) at the end
  int sample_bytes = 0;     // text generated at the end
  std::string sample_prompt = "\n";
  bool progress = true;  // a progress line on a terminal
};

struct StepLog {
  int64_t step = 0;
  double loss = 0;
  double seconds = 0;
  double tokens_per_s = 0;
  bool skipped = false;
  double grad_norm = 0;
  MemoryReport memory;             // rank 0
  CommReport comm;                 // rank 0
  ScheduleReport schedule;         // rank 0
  size_t units_updated_early = 0;  // rank 0: updates overlapped with the backward pass
  uint64_t nvme_read = 0;          // rank 0, this step
  uint64_t nvme_written = 0;
};

struct TrainReport {
  std::vector<StepLog> steps;
  std::vector<MemoryReport> memory;  // per rank, at the end (peaks over the run)
  int world = 1;
  int64_t parameters = 0;          // unpadded
  uint64_t padded_parameters = 0;  // P of the ZeRO arithmetic
  std::string sample;
  double initial_loss = 0;  // loss of the first step
  double final_loss = 0;    // mean loss of the last 10 % of steps
};

using StepCallback = std::function<void(const StepLog&, int total_steps)>;
// Called once by rank 0 when its engine is built: the effective settings (automatic budgets
// resolved) and how the budgets were chosen.
using StartCallback = std::function<void(const EngineSettings& effective, const Budgets& budgets)>;

// Checks the options before anything is allocated: model shape, data (exists, non-empty, longer
// than a window), budgets large enough for one unit, NVMe paths with room for the offloaded state.
Status check_train_options(const TrainOptions& options);

// Trains and returns what rank 0 saw (on other MPI ranks: their own view).
Result<TrainReport> train(const TrainOptions& options, const StepCallback& on_step = {},
                          const StartCallback& on_start = {});

}  // namespace zinf::gpt
