// The main job: the GPT trained through the Engine (ZeRO stages 0-3, CPU/NVMe offload), one rank
// per thread on the local communicator or one per process under mpirun.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/comm/env.h"
#include "zinf/core/status.h"
#include "zinf/engine/engine.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/safetensors.h"  // write_safetensors: the export
#include "zinf/optim/lr_schedule.h"

namespace zinf::gpt {

struct TrainOptions {
  GptConfig model;
  std::string model_name = "custom";  // the preset, for messages
  int batch = 8;                      // sequences per rank per micro-step
  int seq = 0;                        // tokens per sequence; 0 = the model's context
  int steps = 100;
  uint64_t seed = 1;
  std::string data;  // text file; empty = the fortunes corpus
  int ranks = 1;     // local threads (ignored when `launch` is set)
  // One rank per process, started by a launcher (mpirun, srun, ...): the rank, world and backend
  // read from its environment (comm::comm_config_from_env). Unset: `ranks` local threads.
  std::optional<comm::CommConfig> launch;
  // Bound on every wait for a peer (ZINF_COMM_TIMEOUT, read by the CLI). A rank that fails stops
  // its peers at once (Communicator::abort); this bounds the rest (a rank that hangs).
  std::chrono::milliseconds comm_timeout = comm::kDefaultTimeout;
  EngineSettings engine;  // stage, dtype, optimizer, offload, budgets
  // The learning-rate schedule (DeepSpeed's, zinf/optim/lr_schedule.h) over engine.adam.lr; each
  // step runs at its value for the applied steps so far. Type kNone: engine.adam.lr throughout.
  config::SchedulerConfig lr_schedule;
  std::string log_json;     // one JSON object per step
  std::string export_path;  // consolidated fp32 weights (.safetensors) at the end
  // Checkpoints (docs/checkpoints.md). With save_dir, a checkpoint every save_every steps (0 =
  // none on the way) and one after the last step, keeping the newest `keep` (0 = all). resume: a
  // checkpoint directory, a root holding `latest`, or "latest" (save_dir's newest); `steps` is
  // the total, so a resumed run continues from the saved step up to it.
  std::string save_dir;
  int save_every = 0;
  int keep = 0;
  std::string resume;
  // Initial weights from a safetensors file (`zinf train --export`, `zinf checkpoint export`: F32,
  // BF16 or F16) instead of the model's initialiser: its tensors must be the model's parameters
  // ("<unit>.<parameter>") with their shapes, no more and no fewer. The run starts at step 0 with
  // zero optimizer state; each rank reads the elements it holds from the mapped file. Not with
  // `resume` (a checkpoint holds the weights already). With steps = 0 the run takes no step: the
  // weights are exported (export_path) or saved as a step-0 checkpoint (save_dir) as loaded.
  std::string init_from;
  // Clean shutdown: when set (non-zero, e.g. the number of a signal received) the ranks agree to
  // stop after the current step, a checkpoint is saved when save_dir is given, and train()
  // returns kCancelled naming the step (the engines, and with them the swap files, are gone).
  const std::atomic<int>* stop = nullptr;
  int sample_bytes = 0;  // text generated at the end
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
  float lr = 0;                    // the learning rate the step ran with (the schedule's value)
  float beta1 = 0, beta2 = 0;      // Adam's betas the step ran with (OneCycle cycles beta1)
  MemoryReport memory;             // rank 0
  CommReport comm;                 // rank 0
  ScheduleReport schedule;         // rank 0
  size_t units_updated_early = 0;  // rank 0: updates overlapped with the backward pass
  uint64_t nvme_read = 0;          // rank 0, this step
  uint64_t nvme_written = 0;
  NvmeTraffic nvme_minimum;  // rank 0: the least a step must move (Engine::nvme_traffic_minimum)
};

struct TrainReport {
  std::vector<StepLog> steps;
  std::vector<MemoryReport> memory;  // every rank's, at the end (peaks over the run; gathered)
  int world = 1;
  int64_t parameters = 0;          // unpadded
  uint64_t padded_parameters = 0;  // P of the ZeRO arithmetic
  std::string sample;
  double initial_loss = 0;      // loss of the first step
  double final_loss = 0;        // mean loss of the last 10 % of steps
  int64_t resumed_from = 0;     // the step the run started from (a resumed run's checkpoint)
  std::string resumed_path;     // the checkpoint directory it was loaded from
  std::string last_checkpoint;  // the directory of the last checkpoint saved
  // Rank 0's time in save_checkpoint / load_checkpoint (collectives: every rank's files are
  // written or read meanwhile), and the checkpoint's bytes (every rank's files).
  double save_seconds = 0, load_seconds = 0;
  uint64_t save_bytes = 0, load_bytes = 0;
  int saves = 0;
};

using StepCallback = std::function<void(const StepLog&, int total_steps)>;
// Called once by rank 0 when its engine is built: the effective settings (automatic budgets
// resolved) and how the budgets were chosen.
using StartCallback = std::function<void(const EngineSettings& effective, const Budgets& budgets)>;

// Checks the options before anything is allocated: model shape, data (exists, non-empty, longer
// than a window), budgets large enough for one unit, NVMe paths with room for the offloaded state.
Status check_train_options(const TrainOptions& options);

// An output file a run will write (`flag` names it in the error): its directory exists and is
// writable, and the path is not a directory. Checked before training, so a bad path costs
// nothing.
Status check_output_file(std::string_view flag, const std::string& path);

// Trains and returns what rank 0 saw; `memory` holds every rank's row, gathered through the
// communicator. Under a launcher, the other processes get their own view (no steps logged).
Result<TrainReport> train(const TrainOptions& options, const StepCallback& on_step = {},
                          const StartCallback& on_start = {});

}  // namespace zinf::gpt
