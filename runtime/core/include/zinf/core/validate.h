// The value rules that more than one reader of the settings applies: the config reader
// (runtime/config: a JSON file, or a Config built in code), `zinf train`'s flags
// (cli/train_settings.cc) and the engine (EngineSettings, checked when an Engine is built). Each
// rule is written once, here, so a bad value gets one error whichever way it came in. An error
// names the setting as a user sets it, from the table of tunables: its JSON key and its
// `zinf train` flag ("zero_optimization.stage (--stage): expected an integer in 0..3, got 4").
//
// A rule only one reader needs (aio.block_size's alignment, the scheduler's parameters, a
// flag's text) lives with that reader (runtime/config/src/check.cc, cli/train_settings.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "zinf/core/status.h"
#include "zinf/core/tunables.h"

namespace zinf::validate {

// How an error names the setting of `e`: "zero_optimization.stage (--stage)"; its JSON key
// alone where it has no flag, its table name where it has no JSON key.
std::string label(const tunables::Entry& e);

// The ZeRO stage: 0..3.
Status stage(int stage);
// A count that must be at least 1 (gradient_accumulation_steps, micro_batch).
Status positive(const tunables::Entry& e, int64_t value);
// A byte budget given explicitly (device_mem, host_mem): 0 is refused rather than read as
// "unlimited" or as "auto" (which is the setting left out).
Status explicit_budget(const tunables::Entry& e, uint64_t bytes);

// Which state an offload rule is about.
enum class Offloaded { kParams, kOptimizer };
// NVMe offload needs a swap directory: `device` is the table's name of where the state lives
// ("none", "cpu", "nvme"), `paths` how many directories the setting gives.
Status nvme_path_given(Offloaded what, std::string_view device, size_t paths);
// Parameter offload needs stage 3, optimizer offload stage 1..3, and a partial optimizer
// offload (`ratio` < 1) stage 3. Nothing to check when `device` is "none".
Status offload_stage(Offloaded what, std::string_view device, int stage, double ratio = 1.0);
// The share of the optimizer state offloaded: (0, 1].
Status optimizer_offload_ratio(double ratio);

}  // namespace zinf::validate
