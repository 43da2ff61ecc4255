// From a DeepSpeed-format configuration (zinf/config/config.h) to the Engine's settings, and the
// settings as the table of tunables (zinf/core/tunables.h) names them.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string_view>

#include "zinf/config/config.h"
#include "zinf/core/tunables.h"
#include "zinf/engine/engine.h"

namespace zinf {

// Maps every key the engine acts on: each engine entry of the table with one JSON key reads it
// (from config::to_json(c)), and the few that depend on more than one key are mapped by hand.
// Keys accepted but not acted upon are not in the Config at all
// (config::accepted_but_ignored_keys(); parse_config warns about them).
Result<EngineSettings> settings_from_config(const config::Config& c);

// One EngineSettings field: the table entry that declares it (its name), and its value in the
// table's form (below) read and written.
struct EngineField {
  std::string_view name;
  nlohmann::json (*get)(const EngineSettings& s);
  void (*set)(const nlohmann::json& value, EngineSettings& s);
};
// Every EngineSettings field, one per engine entry of the table (a compile-time check in
// settings.cc holds the two lists together).
std::span<const EngineField> engine_fields();

// Every EngineSettings field, keyed by its table name (each tunables::kAll entry read by the
// engine, and nothing else), in the table's form: enums by name ("fp32", "nvme", "cpu-strict"),
// placement as the offload device ("none", "cpu", "nvme"), floats as the shortest decimal that
// reads back to the same float. What `zinf train` prints and logs at start-up, and what the
// agreement test compares.
nlohmann::json settings_json(const EngineSettings& s);

// A table default in the same form (nvme_paths' "" is the empty list).
nlohmann::json tunable_json(const tunables::Entry& e, const tunables::Value& v);

}  // namespace zinf
