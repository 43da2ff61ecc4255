// The training configuration: DeepSpeed's JSON format, so a DeepSpeed user brings their config
// file unchanged, plus an optional "zinf" block for what DeepSpeed has no key for.
//
// Every field below carries DeepSpeed's default (checked against deepspeed/runtime/zero/config.py,
// offload_config.py, swap_tensor/aio_config.py and fp16/bf16 constants) unless it says otherwise.
// docs/configuration.md is the user-facing reference: which keys zinf acts on today and which it
// accepts with no effect yet.
//
// Units: DeepSpeed's ZeRO "sizes" (bucket sizes, thresholds, offload buffer sizes) are numbers of
// parameter ELEMENTS, not bytes; only aio.block_size and the zinf block are in bytes.
//
// Reading a config:
//   ZINF_ASSIGN_OR_RETURN(config::Config cfg, config::load_config(path));  // types, ranges, combos
//   ZINF_RETURN_IF_ERROR(config::resolve_batch_sizes(cfg, world_size));     // needs the world
//   config::log_effective_config(cfg);                                       // once, at start-up
// Every error names the JSON path of the offending key ("zero_optimization.offload_param.device")
// and what was expected. Unknown keys are not errors: parsing logs ONE warning naming all of them
// and lists them in Config::unknown_keys.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf::config {

// Where offloaded state lives. JSON: "none" | "cpu" | "nvme".
enum class OffloadDevice { kNone, kCpu, kNvme };

std::string_view offload_device_name(OffloadDevice d);

// One of zero_optimization.offload_param / zero_optimization.offload_optimizer. The two DeepSpeed
// blocks share this struct; each block accepts only the keys DeepSpeed defines for it (marked
// below), and the fields that do not apply to a block stay at their defaults.
struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;  // both blocks; DeepSpeed "none"
  // both blocks. DeepSpeed takes one directory; zinf also takes a list of directories and
  // stripes the swap files across them. Required (non-empty) when device is kNvme.
  std::vector<std::string> nvme_path;
  // both blocks: buffers in the NVMe staging pool. DeepSpeed: 5 for offload_param, 4 for
  // offload_optimizer (at least the number of states per parameter: Adam has 4).
  int64_t buffer_count = 5;
  uint64_t buffer_size = 100'000'000;   // offload_param only: elements per buffer (DeepSpeed 1e8)
  uint64_t max_in_cpu = 1'000'000'000;  // offload_param only: elements kept in host memory
                                        // when offloading to NVMe (DeepSpeed 1e9)
  bool pin_memory = false;              // both blocks: page-locked host memory
  bool pipeline_read = false;   // offload_optimizer only: read sub-group i+1 during update of i
  bool pipeline_write = false;  // offload_optimizer only: write i-1 back during update of i
  // offload_optimizer only: fraction of the optimizer state offloaded (and updated by the CPU);
  // the rest stays on the device (DeepSpeed's partial offload, "Twin-Flow"). (0, 1]; below 1
  // only with stage 3, as DeepSpeed.
  double ratio = 1.0;
  bool fast_init = false;  // offload_optimizer only: skip writing initial state to NVMe

  bool enabled() const { return device != OffloadDevice::kNone; }
  bool operator==(const OffloadConfig&) const = default;
};

// The top-level "aio" block: DeepSpeed's asynchronous I/O settings, mapped onto zinf's io_uring
// IoEngine (see docs/configuration.md for the mapping).
struct AioConfig {
  uint64_t block_size = 1048576;  // bytes per I/O request; a multiple of 4096
  int queue_depth = 8;            // requests in flight per ring
  // Threads (io_uring rings) that split one large transfer. DeepSpeed before 0.15 called this key
  // "thread_count"; both names are accepted.
  int intra_op_parallelism = 1;
  bool single_submit = false;  // submit requests one at a time instead of in batches
  bool overlap_events = true;  // reap completions while submitting
  bool use_gds = false;        // GPUDirect Storage: accepted; zinf always stages through host

  bool operator==(const AioConfig&) const = default;
};

// The "zero_optimization" block. Sizes are in parameter elements.
struct ZeroConfig {
  int stage = 0;                     // 0 (plain data parallel) .. 3
  bool contiguous_gradients = true;  // gradients copied into one contiguous buffer
  // Reductions overlap the backward pass. DeepSpeed's default depends on the stage: true for
  // stage 3, false otherwise; parse_config applies that rule when the key is absent.
  bool overlap_comm = false;
  bool reduce_scatter = true;                    // reduce-scatter (not all-reduce) of gradients
  uint64_t reduce_bucket_size = 500'000'000;     // elements reduced at once (DeepSpeed 5e8)
  bool allgather_partitions = true;              // all-gather (not broadcasts) after the step
  uint64_t allgather_bucket_size = 500'000'000;  // elements all-gathered at once (5e8)
  // Optimizer sub-group ("tile") size for offloaded updates, in elements (DeepSpeed 1e9).
  // 0 = one sub-group per parameter unit.
  uint64_t sub_group_size = 1'000'000'000;
  // Stage 3 (each key also accepted without the "stage3_" prefix, as DeepSpeed does):
  uint64_t stage3_prefetch_bucket_size = 50'000'000;      // elements fetched ahead (5e7); 0 = none
  uint64_t stage3_param_persistence_threshold = 100'000;  // smaller params stay whole (1e5)
  uint64_t stage3_max_live_parameters = 1'000'000'000;    // live gathered elements (1e9)
  uint64_t stage3_max_reuse_distance = 1'000'000'000;     // keep if reused within this (1e9)
  OffloadConfig offload_param{.buffer_count = 5};         // stage 3 only
  OffloadConfig offload_optimizer{.buffer_count = 4};     // stage 1..3

  bool operator==(const ZeroConfig&) const = default;
};

// The "optimizer" block. Type names are matched case-insensitively, as DeepSpeed does.
//
// Weight decay, as DeepSpeed (FusedAdam / DeepSpeedCPUAdam) and PyTorch apply it:
//  - decoupled (AdamW, Loshchilov & Hutter): p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p),
//    the same as torch.optim.AdamW's p *= 1 - lr * wd before the Adam update;
//  - L2 (classic Adam, torch.optim.Adam(weight_decay=wd)): g += wd * p before the moments.
// type "AdamW" is always decoupled. type "Adam" is decoupled too unless params.adam_w_mode is
// false: DeepSpeed's adam_w_mode defaults to true, so a DeepSpeed "Adam" with weight_decay > 0
// is AdamW unless the config says "adam_w_mode": false.
struct OptimizerConfig {
  enum class Type { kAdam, kAdamW };
  // When the config has no "optimizer" block (DeepSpeed then uses the client's optimizer), zinf
  // uses Adam with DeepSpeed FusedAdam's defaults.
  Type type = Type::kAdam;
  float lr = 1e-3f;           // >= 0
  float beta1 = 0.9f;         // params.betas[0], in [0, 1)
  float beta2 = 0.999f;       // params.betas[1], in [0, 1)
  float eps = 1e-8f;          // > 0; added to the bias-corrected sqrt(v)
  float weight_decay = 0.0f;  // >= 0
  bool adam_w_mode = true;    // effective: true = decoupled decay, false = L2 (see above)
  bool bias_correction = true;

  bool operator==(const OptimizerConfig&) const = default;
};

std::string_view optimizer_type_name(OptimizerConfig::Type t);

// The "fp16" block: fp16 working precision with (by default dynamic) loss scaling.
struct Fp16Config {
  bool enabled = false;
  float loss_scale = 0;          // 0 = dynamic scaling; > 0 = this fixed scale
  int initial_scale_power = 16;  // dynamic: the first scale is 2^initial_scale_power
  int loss_scale_window = 1000;  // dynamic: steps without overflow before the scale doubles
  int hysteresis = 2;            // dynamic: overflows tolerated before the scale is halved
  float min_loss_scale = 1;      // dynamic: the scale never drops below this

  bool operator==(const Fp16Config&) const = default;
};

// The "zinf" block: zinf's own settings, which DeepSpeed has no key for. Byte values accept
// integers or strings such as "4G" or "512MiB" (binary multiples).
struct ZinfConfig {
  uint64_t device_mem = 0;              // device byte budget; 0 = unlimited (the device's size)
  uint64_t host_mem = 0;                // pinned host byte budget; 0 = unlimited
  std::string trace;                    // Chrome/Perfetto trace file to write; "" = no trace
  uint64_t seed = 0;                    // parameter initialisation seed
  bool checksum = false;                // XXH3 per swapped extent, verified on every read
  uint64_t staging_bytes = 4ull << 20;  // NVMe <-> device staging piece; a multiple of 1 MiB
  // Start each unit's optimizer update during the backward pass once its gradients are final
  // (EngineSettings::overlap_optimizer).
  bool overlap_optimizer = false;

  bool operator==(const ZinfConfig&) const = default;
};

struct Config {
  // Batch sizes follow DeepSpeed: train_batch_size = micro * accumulation * world size, and any
  // one of the three may be left out and derived. 0 means "not given, derive it": parse_config
  // leaves train_batch_size at 0 when absent, and leaves the micro batch or the accumulation steps
  // at 0 when train_batch_size is given without them; resolve_batch_sizes() fills them in once
  // the world size is known. (DeepSpeed requires train_batch_size or the micro batch; zinf
  // defaults the micro batch to 1.)
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 1;
  int64_t gradient_accumulation_steps = 1;
  float gradient_clipping = 0;  // global gradient-norm bound; 0 = no clipping
  OptimizerConfig optimizer;
  Fp16Config fp16;
  bool bf16 = false;  // "bf16": {"enabled": ...} (also accepted as DeepSpeed's older "bfloat16")
  ZeroConfig zero;
  AioConfig aio;
  ZinfConfig zinf;
  nlohmann::json scheduler;  // the raw "scheduler" block (null when absent); not interpreted

  // Filled by parse_config, not part of the effective configuration (to_json leaves them out):
  std::vector<std::string> unknown_keys;  // JSON paths of keys zinf does not know, sorted
  std::vector<std::string> auto_keys;     // JSON paths given as "auto", left at their default

  // fp16 when fp16.enabled, bf16 when bf16, else fp32.
  DType working_dtype() const;

  bool operator==(const Config&) const = default;
};

// Reads a parsed JSON document. Checks every key's type and range and the combinations that do
// not need the world size (fp16 with bf16, parameter offload below stage 3, ...). Logs one
// warning naming the unknown keys, if any.
Result<Config> parse_config(const nlohmann::json& j);
// Parses JSON text first; a syntax error names the line and column.
Result<Config> parse_config_text(std::string_view text);
// Reads a file; a missing or unreadable file is named in the error.
Result<Config> load_config(const std::string& path);

// Checks the whole Config as parse_config does (useful for a Config built in code), plus what
// needs the world: the batch-size relation. Does not modify `c`.
Status validate(const Config& c, int world_size);
// validate(), then derives the batch sizes left at 0 as DeepSpeed does: micro batch =
// train_batch_size / (accumulation * world), accumulation = train_batch_size / (micro * world),
// train_batch_size = micro * accumulation * world.
Status resolve_batch_sizes(Config& c, int world_size);

// The effective configuration in DeepSpeed's format: parse_config(to_json(c)) == c, except for
// unknown_keys and auto_keys. Keys left at 0 ("derive") are left out.
nlohmann::json to_json(const Config& c);

// Logs every tunable once, one line per block (STYLE.md 11), and which keys were "auto".
void log_effective_config(const Config& c);

}  // namespace zinf::config
