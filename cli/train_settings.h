// What `zinf train` runs with: the table of tunables (zinf/core/tunables.h), then `zinf train`'s
// own defaults (the table's `train` values), then the keys the --config file sets, then the
// flags. Everything goes through one config::Config and settings_from_config, so a flag means
// exactly what its JSON key means (DeepSpeed's stage-dependent overlap_comm included), and a run
// is the same with and without a config file that leaves a key out.
//
// A library of its own (zinf_cli_train) so tests/settings can check that the CLI, the config
// reader and EngineSettings{} agree without running the command.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "zinf/config/config.h"
#include "zinf/engine/settings.h"

namespace zinf::cli {

// The flags of `zinf train` that set tunables, by flag ("--stage"), each with what the command
// line gave it: its text (every occurrence for a list, --nvme-path), nothing for a switch
// (--no-checksum). A flag absent here was not given.
using TrainFlags = std::map<std::string, std::vector<std::string>, std::less<>>;

// The flag of every table entry that has one, registered on a CLI11 command from the table: its
// help says what it does, its JSON key and what leaving it out means (`zinf train`'s own default,
// else the table's). A bool entry's flag is a switch to the other value.
class TrainFlagOptions {
 public:
  // Adds the flags to `sub`; this object must outlive the parse.
  void add_to(CLI::App& sub);
  // The flags the parse gave.
  TrainFlags given() const;

 private:
  struct Storage {
    std::string text;
    std::vector<std::string> list;
    bool on = false;
  };
  const CLI::App* app_ = nullptr;
  std::map<std::string, Storage, std::less<>> storage_;  // by flag; nodes stay where they are
};

// What the run knows beyond the flags, for DeepSpeed's "auto" values (resolved as the Hugging Face
// integration resolves them) and the schedule's length.
struct RunFacts {
  // The model's hidden size: reduce_bucket_size "auto" = hidden^2, stage3_prefetch_bucket_size
  // 0.9 hidden^2, stage3_param_persistence_threshold 10 hidden. 0 = not known: those keys keep
  // their defaults, and say so.
  int64_t hidden = 0;
  // The optimizer steps of the run (--steps): scheduler.params.total_num_steps when "auto" or
  // when --lr-schedule names a decaying schedule without it. Unset (zinf estimate, which does not
  // train): the schedule's "auto" values are left unresolved and the schedule is not checked.
  std::optional<int64_t> steps;
};

// Where a setting's value came from.
enum class Source {
  kDefault,    // the table's default
  kTrain,      // `zinf train`'s own default (the table's `train` value)
  kStageRule,  // DeepSpeed's rule from the stage (overlap_comm: on for stage 3)
  kConfig,     // the --config file
  kFlag,       // a flag
  kAuto,       // the config's "auto", resolved from the run (TrainSettings::auto_values)
};
std::string_view source_name(Source s);

struct TrainSettings {
  EngineSettings engine;
  config::Config config;  // the effective configuration the engine settings were built from
  int batch = 0;          // sequences per rank per micro-step (train_micro_batch_size_per_gpu)
  uint64_t seed = 0;      // also engine.seed: the initialisation, the data order, the sample
  std::string trace;      // zinf.trace: Chrome/Perfetto trace file; "" = none
  // By table name; an entry absent here is at the table's default.
  std::map<std::string, Source, std::less<>> sources;
  // Every key the config gives as "auto", by JSON path: the value it resolved to (JSON text) and
  // what from ("--lr", "hidden^2, hidden 768", ...).
  struct AutoValue {
    std::string value;
    std::string from;
  };
  std::map<std::string, AutoValue, std::less<>> auto_values;
};

// Builds the settings. `cfg`: the parsed --config file, or nullptr when there is none. `world`:
// the ranks, for DeepSpeed's batch-size derivation. A bad flag or combination is a CliError
// (exit code 2) naming the flag or the JSON key.
TrainSettings build_train_settings(const TrainFlags& flags, const config::Config* cfg, int world,
                                   const RunFacts& run = {});

// Every tunables::kAll entry by name, with its effective value (settings_json's form).
nlohmann::ordered_json effective_settings_json(const TrainSettings& s);

// The first line of --log-json: {"settings": {name: value, ...}, "set_by": {name: source, ...},
// "auto": {json path: resolved, ...}, "scheduler": {...}} (set_by lists the settings not at the
// table's default; "auto" and "scheduler" only when there are any).
nlohmann::ordered_json settings_log_line(const TrainSettings& s);

// The start-up line: every setting not left at the table's default (set by a flag, the config,
// zinf train's own default, DeepSpeed's stage rule or an "auto"), `name=value (source)`, on one
// line.
std::string settings_line(const TrainSettings& s);

// The whole table (--show-settings): "settings ..." and indented lines of `name=value`, each
// marked with where it came from unless it is the table's default ("(auto: ...)" for the config's
// "auto"); then the schedule's parameters and every "auto" key with what it resolved to; lines of
// at most `width` columns.
std::string settings_block(const TrainSettings& s, size_t width = 100);

}  // namespace zinf::cli
