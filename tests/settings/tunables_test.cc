// The table of tunables (zinf/core/tunables.h) is the only place a default is written. These tests
// hold the three readers of it against the table and against each other, entry by entry:
//   - the engine: EngineSettings{};
//   - the config reader: settings_from_config(parse_config("{}")), and a one-line config;
//   - `zinf train`: build_train_settings() with no flags, with --config "{}", with flags.
// A default written a second time anywhere (a literal in EngineSettings, config.h or the CLI)
// makes one of them fail; TheComparisonIsNotVacuous shows that the comparison sees a change.
// EverySettingReachesTheEngineByItsFlagAndItsKey sets each entry through its flag (parsed by
// CLI11 from the table's registration) and its JSON key; ARuleIsWrittenOnce holds the config
// reader, the CLI and the engine to one error per bad value.
#include "zinf/core/tunables.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "../engine/mlp.h"
#include "command.h"
#include "train_settings.h"
#include "zinf/config/config.h"
#include "zinf/core/validate.h"
#include "zinf/engine/settings.h"

namespace zinf {
namespace {

namespace t = tunables;
using cli::build_train_settings;
using cli::Source;
using cli::TrainFlags;
using cli::TrainSettings;
using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ---- helpers
// -------------------------------------------------------------------------------------

config::Config parse(std::string_view text) {
  Result<config::Config> c = config::parse_config_text(text);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string() << "\n" << text;
  return c.is_ok() ? *c : config::Config{};
}

EngineSettings from_config(std::string_view text) {
  Result<EngineSettings> s = settings_from_config(parse(text));
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? *s : EngineSettings{};
}

// The CLI's settings as plain json (for comparisons with settings_json()).
json cli_json(const TrainSettings& s) {
  return json::parse(cli::effective_settings_json(s).dump());
}

TrainSettings cli_run(const TrainFlags& flags = {}, std::string_view config_text = {}) {
  if (config_text.empty()) return build_train_settings(flags, nullptr, 1);
  config::Config c = parse(config_text);
  return build_train_settings(flags, &c, 1);
}

// The names whose values differ between `a` and `b` (keys of either).
std::set<std::string> differences(const json& a, const json& b) {
  std::set<std::string> out;
  for (const auto& [key, value] : a.items()) {
    if (!b.contains(key) || b.at(key) != value) out.insert(key);
  }
  for (const auto& [key, value] : b.items()) {
    if (!a.contains(key)) out.insert(key);
  }
  return out;
}

json table_default(const t::Entry& e) { return tunable_json(e, e.value); }

std::set<std::string> engine_entry_names() {
  std::set<std::string> names;
  for (const t::Entry& e : t::kAll) {
    if (e.reader == t::Reader::kEngine) names.insert(std::string(e.name));
  }
  return names;
}

// Members of an aggregate, counted by aggregate-initialising it from ever more placeholders that
// convert to any type (as boost::pfr does). Only used in unevaluated context.
struct AnyField {
  template <class T>
  operator T() const;  // NOLINT: implicit on purpose
};
template <class T, class... Fields>
constexpr size_t field_count() {
  if constexpr (requires { T{Fields{}..., AnyField{}}; }) {
    return field_count<T, Fields..., AnyField>();
  } else {
    return sizeof...(Fields);
  }
}

// ---- the table and the engine
// ---------------------------------------------------------------------

TEST(Tunables, EntriesAreWellFormed) {
  std::set<std::string_view> names, flags;
  for (const t::Entry& e : t::kAll) {
    SCOPED_TRACE(std::string(e.name));
    EXPECT_TRUE(names.insert(e.name).second) << "a name twice";
    if (!e.flag.empty()) {
      EXPECT_TRUE(flags.insert(e.flag).second) << "a flag twice";
    }
    EXPECT_FALSE(e.doc.empty());
    EXPECT_EQ(t::find(e.name), &e);
    // A key that sets a tunable is acted on, so it is not in the accepted-but-ignored list.
    for (const config::IgnoredKey& k : config::accepted_but_ignored_keys()) {
      EXPECT_THAT(std::string(e.json), ::testing::Not(HasSubstr(std::string(k.path))));
    }
    if (e.train) {
      EXPECT_NE(*e.train, e.value) << "a train value equal to the default";
    }
  }
  EXPECT_EQ(t::find("no such setting"), nullptr);
}

// A field added to EngineSettings without an entry (and its line in engine_fields()) fails here.
TEST(Tunables, EveryEngineFieldHasAnEntry) {
  std::set<std::string> engine_names = engine_entry_names();
  std::set<std::string> json_names;
  const json defaults = settings_json(EngineSettings{});
  for (const auto& [key, value] : defaults.items()) json_names.insert(key);
  EXPECT_EQ(json_names, engine_names) << "settings_json() and the table's engine entries";

  size_t adam_entries = 0;
  for (const std::string& n : engine_names) adam_entries += n.starts_with("adam.");
  EXPECT_EQ(field_count<kernels::AdamConfig>(), adam_entries)
      << "kernels::AdamConfig gained or lost a field: give it an adam.* entry in tunables.h";
  EXPECT_EQ(field_count<EngineSettings>(), engine_names.size() - adam_entries + 1)
      << "EngineSettings gained or lost a field: give it an entry in tunables.h and a line in "
         "engine_fields() (runtime/engine/src/settings.cc)";
}

TEST(Tunables, EngineSettingsDefaultsAreTheTable) {
  const json engine = settings_json(EngineSettings{});
  for (const t::Entry& e : t::kAll) {
    if (e.reader != t::Reader::kEngine) continue;
    EXPECT_EQ(engine.at(std::string(e.name)), table_default(e)) << e.name;
  }
}

// ---- the config reader
// ----------------------------------------------------------------------------

TEST(Tunables, ConfigReaderDefaultsAreTheTable) {
  EXPECT_EQ(parse("{}"), config::Config{});
  EXPECT_EQ(differences(settings_json(from_config("{}")), settings_json(EngineSettings{})),
            std::set<std::string>{});

  // The entries only the config reader holds.
  const config::Config c = parse("{}");
  EXPECT_EQ(config::optimizer_type_name(c.optimizer.type), t::kOptimizerType.value);
  EXPECT_EQ(c.zero.offload_param.buffer_count, t::kParamBufferCount.value);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, t::kMicroBatch.value);
  EXPECT_EQ(c.zinf.trace, t::kTrace.value);

  // Every entry with one JSON key that to_json writes: the value there is the table's.
  const json written = config::to_json(c);
  size_t compared = 0;
  for (const t::Entry& e : t::kAll) {
    std::string path(e.json);
    if (path.empty() || path.find(',') != std::string::npos) continue;
    std::string pointer = "/" + path;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    if (!written.contains(json::json_pointer(pointer))) continue;
    const json& v = written.at(json::json_pointer(pointer));
    if (!v.is_primitive()) continue;  // betas: the pair
    EXPECT_EQ(v, table_default(e)) << e.name << " at " << path;
    ++compared;
  }
  EXPECT_GE(compared, 25u) << "the walk over to_json() compared too little";
}

TEST(Tunables, AOneLineConfigChangesOnlyItsKey) {
  const json defaults = settings_json(EngineSettings{});
  EXPECT_EQ(differences(settings_json(from_config(R"({"aio": {"queue_depth": 16}})")), defaults),
            std::set<std::string>{"io_queue_depth"});
  EXPECT_EQ(
      differences(settings_json(from_config(R"({"zinf": {"staging_bytes": "8M"}})")), defaults),
      std::set<std::string>{"staging_bytes"});
  // DeepSpeed's rule: overlap_comm follows the stage when the key is absent.
  EXPECT_EQ(
      differences(settings_json(from_config(R"({"zero_optimization": {"stage": 3}})")), defaults),
      (std::set<std::string>{"overlap_comm", "stage"}));
  // offload_param.max_in_cpu is acted on: it reaches the engine.
  EngineSettings s = from_config(R"({"zero_optimization": {"stage": 3, "offload_param":
      {"device": "nvme", "nvme_path": "/n", "max_in_cpu": 5e8}}})");
  EXPECT_EQ(s.param_max_in_cpu, 500'000'000u);
  EXPECT_EQ(s.staging_buffers, static_cast<uint32_t>(t::kParamBufferCount.value))
      << "offload_param.buffer_count when parameters are offloaded";
}

// ---- zinf train
// -----------------------------------------------------------------------------------

// The DeepSpeed config that holds zinf train's own defaults (the table's `train` values).
std::string recipe_config() {
  json j = json::object();
  for (const t::Entry& e : t::kAll) {
    if (!e.train) continue;
    std::string pointer = "/" + std::string(e.json);
    EXPECT_EQ(pointer.find(','), std::string::npos) << e.name;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[json::json_pointer(pointer)] = tunable_json(e, *e.train);
  }
  if (j.contains("optimizer")) j["optimizer"]["type"] = std::string(t::kOptimizerType.value);
  return j.dump();
}

TEST(Tunables, ZinfTrainWithoutFlagsRunsTheTableAndItsOwnDefaults) {
  const TrainSettings s = cli_run();
  const json cli = cli_json(s);
  for (const t::Entry& e : t::kAll) {
    SCOPED_TRACE(std::string(e.name));
    const std::string name(e.name);
    ASSERT_TRUE(cli.contains(name));
    if (e.train) {
      EXPECT_EQ(cli.at(name), tunable_json(e, *e.train));
      EXPECT_EQ(s.sources.at(name), Source::kTrain);
    } else if (e.name == t::kOverlapComm.name) {
      EXPECT_EQ(cli.at(name), cli.at("stage") == 3) << "DeepSpeed's rule, as the config reader";
    } else {
      EXPECT_EQ(cli.at(name), table_default(e));
      EXPECT_FALSE(s.sources.contains(name));
    }
  }
  // The same engine settings as the config reader gives for a config holding the recipe.
  EXPECT_EQ(differences(settings_json(s.engine), settings_json(from_config(recipe_config()))),
            std::set<std::string>{});
  EXPECT_EQ(s.batch, *t::kMicroBatch.train);
  EXPECT_EQ(s.seed, s.engine.seed);
}

TEST(Tunables, ZinfTrainIsTheSameWithAndWithoutAConfigThatLeavesKeysOut) {
  const TrainSettings plain = cli_run();
  const TrainSettings empty = cli_run({}, "{}");
  EXPECT_EQ(differences(cli_json(plain), cli_json(empty)), std::set<std::string>{});
  EXPECT_EQ(plain.sources, empty.sources);

  const TrainSettings one_line = cli_run({}, R"({"aio": {"queue_depth": 16}})");
  EXPECT_EQ(differences(cli_json(plain), cli_json(one_line)),
            std::set<std::string>{"io_queue_depth"});
  EXPECT_EQ(one_line.engine.io_queue_depth, 16u);
  EXPECT_EQ(one_line.sources.at("io_queue_depth"), Source::kConfig);

  // A config that sets a key zinf train has its own default for: the config's value.
  const TrainSettings staged = cli_run({}, R"({"zero_optimization": {"stage": 2}})");
  EXPECT_EQ(differences(cli_json(plain), cli_json(staged)),
            (std::set<std::string>{"overlap_comm", "stage"}));
  EXPECT_EQ(staged.sources.at("stage"), Source::kConfig);
  EXPECT_FALSE(staged.engine.overlap_comm);
  EXPECT_EQ(staged.sources.at("adam.lr"), Source::kTrain);

  // "auto" is left to the trainer, as the Hugging Face integration does: zinf train's value.
  const TrainSettings autos = cli_run({}, R"({"optimizer": {"type": "Adam", "params":
                                             {"lr": "auto"}}, "train_batch_size": "auto"})");
  EXPECT_EQ(autos.engine.adam.lr, *t::kLr.train);
  EXPECT_EQ(autos.batch, *t::kMicroBatch.train);
  // train_batch_size alone sets the micro batch through DeepSpeed's derivation (world 1).
  EXPECT_EQ(cli_run({}, R"({"train_batch_size": 3})").batch, 3);
}

TEST(Tunables, FlagsWinOverTheConfig) {
  const TrainFlags f = {{"--stage", {"1"}},         {"--dtype", {"bf16"}},
                        {"--lr", {"0.25"}},         {"--offload-optimizer", {"nvme"}},
                        {"--nvme-path", {"/swap"}}, {"--sub-group", {"4096"}},
                        {"--device-mem", {"3G"}}};
  const TrainSettings s = cli_run(f, R"({"zero_optimization": {"stage": 3}, "fp16":
      {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
      "aio": {"queue_depth": 16}})");
  EXPECT_EQ(s.engine.stage, 1);
  EXPECT_FALSE(s.engine.overlap_comm) << "the stage rule follows the flag's stage";
  EXPECT_EQ(s.engine.dtype, DType::kBF16);
  EXPECT_EQ(s.engine.adam.lr, 0.25f);
  EXPECT_EQ(s.engine.optimizer_home, Tier::kNvme);
  EXPECT_EQ(s.engine.nvme_paths, std::vector<std::string>{"/swap"});
  EXPECT_EQ(s.engine.sub_group_elements, 4096u);
  EXPECT_EQ(s.engine.device_mem, 3ull << 30);
  EXPECT_EQ(s.engine.host_mem, 0u) << "auto";
  EXPECT_EQ(s.engine.io_queue_depth, 16u);
  EXPECT_EQ(s.sources.at("stage"), Source::kFlag);
  EXPECT_EQ(s.sources.at("dtype"), Source::kFlag);
  EXPECT_EQ(s.sources.at("io_queue_depth"), Source::kConfig);
  EXPECT_FALSE(s.sources.contains("host_mem"));
}

// Swap checksums are on by default everywhere; --no-checksum (or zinf.checksum false) turns them
// off, the flag winning over the config.
TEST(Tunables, ChecksumsAreOnByDefaultAndNoChecksumTurnsThemOff) {
  EXPECT_TRUE(EngineSettings{}.checksum);
  EXPECT_TRUE(cli_run().engine.checksum);
  EXPECT_FALSE(cli_run().sources.contains("checksum"));
  const TrainSettings flag = cli_run({{"--no-checksum", {}}}, R"({"zinf": {"checksum": true}})");
  EXPECT_FALSE(flag.engine.checksum);
  EXPECT_EQ(flag.sources.at("checksum"), Source::kFlag);
  EXPECT_EQ(differences(cli_json(cli_run()), cli_json(cli_run({{"--no-checksum", {}}}))),
            std::set<std::string>{"checksum"});
  const TrainSettings config = cli_run({}, R"({"zinf": {"checksum": false}})");
  EXPECT_FALSE(config.engine.checksum);
  EXPECT_EQ(config.sources.at("checksum"), Source::kConfig);
  EXPECT_THAT(cli::settings_block(flag), HasSubstr("checksum=false (flag)"));
}

TEST(Tunables, BadFlagsAreErrorsNamingTheFlag) {
  struct Bad {
    TrainFlags flags;
    const char* message;
  };
  const Bad cases[] = {
      {{{"--device-mem", {"0"}}},
       "zinf.device_mem (--device-mem): expected a positive byte count such as 2G, got 0; leave it "
       "out"},
      {{{"--host-mem", {"0G"}}},
       "zinf.host_mem (--host-mem): expected a positive byte count such as 2G, got 0"},
      {{{"--host-mem", {"lots"}}}, "--host-mem"},
      {{{"--stage", {"4"}}},
       "zero_optimization.stage (--stage): expected an integer in 0..3, got 4"},
      {{{"--dtype", {"fp8"}}}, "--dtype must be fp32, bf16 or fp16, got 'fp8'"},
      {{{"--stage", {"2"}}, {"--offload-param", {"cpu"}}},
       "zero_optimization.offload_param.device (--offload-param): parameter offload needs "
       "zero_optimization.stage 3 (--stage 3), got device \"cpu\" with stage 2"},
      {{{"--offload-param", {"nvme"}}},
       "zero_optimization.offload_param.nvme_path (--nvme-path DIR): expected a directory on the "
       "NVMe file system (or a list of them) for device \"nvme\" (--offload-param nvme), got none"},
      {{{"--offload-optimizer", {"disk"}}},
       "zero_optimization.offload_optimizer.device (--offload-optimizer): expected none, cpu or "
       "nvme, got 'disk'"},
      {{{"--max-live", {"1.5"}}}, "--max-live: expected a non-negative whole number of elements"},
      {{{"--grad-accum", {"0"}}},
       "gradient_accumulation_steps (--grad-accum): expected a positive integer, got 0"},
  };
  for (const Bad& bad : cases) {
    try {
      cli_run(bad.flags);
      ADD_FAILURE() << "no error for " << bad.message;
    } catch (const cli::CliError& e) {
      EXPECT_THAT(e.what(), HasSubstr(bad.message));
      EXPECT_EQ(e.code, 2) << bad.message;
    }
  }
  // The config's own zero budget is refused by the reader, naming the key.
  Result<config::Config> c = config::parse_config_text(R"({"zinf": {"host_mem": 0}})");
  ASSERT_FALSE(c.is_ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("zinf.host_mem (--host-mem): expected a positive byte count"));
}

// ---- one way in per setting
// ----------------------------------------------------------------------

// A config every entry can be set against: stage 3, a swap directory, an optimizer block.
constexpr std::string_view kBase = R"({"optimizer": {"type": "Adam"}, "zero_optimization":
    {"stage": 3, "offload_param": {"nvme_path": "/swap"}, "offload_optimizer":
    {"nvme_path": "/swap"}}})";

// A valid value other than `base` (the setting's value in kBase's run) for entry `e`.
json other_value(const t::Entry& e, const json& base) {
  if (e.list) return json::array({"/other"});
  if (base.is_boolean()) return !base.get<bool>();
  if (base.is_string()) {
    const std::string b = base.get<std::string>();
    if (e.name == t::kDtype.name) return "bf16";
    if (e.name == t::kDevice.name) return b == "cpu" ? "cpu-strict" : "cpu";
    return b == "cpu" ? "nvme" : "cpu";  // param_home, optimizer_home
  }
  if (base.is_number_float()) {
    const double b = base.get<double>();
    return b == 0 ? 0.5 : b / 2;
  }
  if (e.name == t::kStage.name) return base.get<int>() == 3 ? 2 : 3;
  if (e.unit == t::Unit::kBytes) return base.get<uint64_t>() + (1u << 20);
  return base.get<int64_t>() + 1;
}

// `zinf train`'s command line after "zinf train" ("--stage", "2", ...), parsed by CLI11 with the
// flags the table registers.
TrainFlags parse_flags(std::vector<std::string> args) {
  CLI::App app;
  cli::TrainFlagOptions options;
  options.add_to(app);
  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  app.parse(args);
  return options.given();
}

// The config kBase with `value` at the JSON key of `e`: a list at each of its keys, a dtype as
// its block's "enabled", pin_memory with its block enabled (the engine pins only then).
std::string with_key(const t::Entry& e, const json& value) {
  json j = json::parse(kBase);
  auto set = [&](std::string_view path, const json& v) {
    std::string pointer = "/" + std::string(path);
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[json::json_pointer(pointer)] = v;
  };
  if (e.name == t::kDtype.name) {
    set(value.get<std::string>() + ".enabled", true);
    return j.dump();
  }
  if (e.name == t::kPinMemory.name) set("zero_optimization.offload_param.device", "cpu");
  std::string_view paths = e.json;
  while (!paths.empty()) {
    const size_t comma = paths.find(',');
    set(paths.substr(0, comma), value);
    if (!e.list) break;
    paths = comma == std::string_view::npos ? "" : paths.substr(comma + 2);
  }
  return j.dump();
}

// The settings that follow another: overlap_comm the stage (DeepSpeed's rule), staging_buffers
// the offload block that moves to the device (offload_param's buffer_count once it is on).
std::set<std::string> changed_with(std::string_view name) {
  std::set<std::string> out{std::string(name)};
  if (name == t::kStage.name) out.insert(std::string(t::kOverlapComm.name));
  if (name == t::kParamHome.name) out.insert(std::string(t::kStagingBuffers.name));
  return out;
}

TEST(Tunables, EverySettingReachesTheEngineByItsFlagAndItsKey) {
  const json base = settings_json(cli_run({}, kBase).engine);
  size_t by_flag = 0, by_key = 0;
  for (const t::Entry& e : t::kAll) {
    if (e.reader != t::Reader::kEngine) continue;
    SCOPED_TRACE(std::string(e.name));
    const std::string name(e.name);
    const json other = other_value(e, base.at(name));
    if (!e.flag.empty()) {
      std::vector<std::string> args;
      if (!std::holds_alternative<bool>(e.value)) {
        for (const json& v : other.is_array() ? other : json::array({other})) {
          args.push_back(std::string(e.flag));
          args.push_back(v.is_string() ? v.get<std::string>() : v.dump());
        }
      } else {
        ASSERT_NE(other, tunable_json(e, e.value)) << "the switch sets the other value";
        args.push_back(std::string(e.flag));
      }
      const TrainSettings s = cli_run(parse_flags(args), kBase);
      EXPECT_EQ(settings_json(s.engine).at(name), other) << "by " << e.flag;
      EXPECT_EQ(differences(settings_json(s.engine), base), changed_with(e.name));
      EXPECT_EQ(s.sources.at(name), Source::kFlag);
      ++by_flag;
    }
    if (!e.json.empty() && e.json != t::kBeta1.json) {  // betas: both in one key, below
      const TrainSettings s = cli_run({}, with_key(e, other));
      EXPECT_EQ(settings_json(s.engine).at(name), other) << "by " << e.json;
      const EngineSettings reader = from_config(with_key(e, other));
      EXPECT_EQ(settings_json(reader).at(name), other) << "the config reader, by " << e.json;
      EXPECT_EQ(s.sources.at(name), Source::kConfig);
      ++by_key;
    }
  }
  const EngineSettings betas = from_config(R"({"optimizer": {"type": "Adam", "params":
      {"betas": [0.5, 0.75]}}})");
  EXPECT_EQ(betas.adam.beta1, 0.5f);
  EXPECT_EQ(betas.adam.beta2, 0.75f);
  EXPECT_GE(by_flag, 15u);
  EXPECT_GE(by_key, 40u);
}

// Each EngineSettings field the table names is the one settings_json() reads.
TEST(Tunables, EngineFieldsAreTheEngineEntries) {
  std::set<std::string> fields;
  for (const EngineField& f : engine_fields()) fields.insert(std::string(f.name));
  EXPECT_EQ(fields, engine_entry_names());
  EngineSettings s;
  s.io_rings = 3;
  for (const EngineField& f : engine_fields()) {
    EXPECT_EQ(f.get(s) == f.get(EngineSettings{}), f.name != t::kIoRings.name) << f.name;
  }
}

// The rules of zinf/core/validate.h: a bad value is refused by the config reader, by `zinf train`
// and by the engine with the one error the rule writes.
std::string config_error(std::string_view text) {
  Result<config::Config> c = config::parse_config_text(text);
  EXPECT_FALSE(c.is_ok()) << text;
  return c.is_ok() ? "" : c.status().message();
}
std::string cli_error(const TrainFlags& flags) {
  try {
    cli_run(flags);
  } catch (const cli::CliError& e) {
    EXPECT_EQ(e.code, 2);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}
std::string engine_error(const EngineSettings& s) {
  auto group = comm::make_local_group(1).value();
  auto e = Engine::create(s, *group[0], testing::mlp_units({}), testing::mlp_init);
  EXPECT_FALSE(e.is_ok());
  return e.is_ok() ? "" : e.status().message();
}

TEST(Tunables, ARuleIsWrittenOnce) {
  const std::string stage = validate::stage(5).message();
  EXPECT_EQ(stage, "zero_optimization.stage (--stage): expected an integer in 0..3, got 5");
  EXPECT_EQ(config_error(R"({"zero_optimization": {"stage": 5}})"), stage);
  EXPECT_EQ(cli_error({{"--stage", {"5"}}}), stage);
  EXPECT_EQ(engine_error({.stage = 5}), stage);

  const std::string nvme =
      validate::nvme_path_given(validate::Offloaded::kOptimizer, "nvme", 0).message();
  EXPECT_THAT(nvme, HasSubstr("zero_optimization.offload_optimizer.nvme_path (--nvme-path DIR)"));
  EXPECT_THAT(nvme, HasSubstr("(--offload-optimizer nvme)"));
  EXPECT_EQ(config_error(
                R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})"),
            nvme);
  EXPECT_EQ(cli_error({{"--offload-optimizer", {"nvme"}}}), nvme);
  EXPECT_EQ(engine_error({.stage = 3, .optimizer_home = Tier::kNvme}), nvme);

  const std::string accumulation =
      validate::positive(*t::find(t::kGradientAccumulationSteps.name), 0).message();
  EXPECT_EQ(config_error(R"({"gradient_accumulation_steps": 0})"), accumulation);
  EXPECT_EQ(cli_error({{"--grad-accum", {"0"}}}), accumulation);
  EXPECT_EQ(engine_error({.gradient_accumulation_steps = 0}), accumulation);

  // DeepSpeed's overlap_comm rule, once: the config reader and zinf train follow the stage.
  for (int st = 0; st <= 3; ++st) {
    SCOPED_TRACE(st);
    const std::string text = fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", st);
    EXPECT_EQ(parse(text).zero.overlap_comm, t::overlap_comm_for_stage(st));
    EXPECT_EQ(cli_run({{"--stage", {std::to_string(st)}}}).engine.overlap_comm,
              t::overlap_comm_for_stage(st));
  }
}

// ---- the learning-rate schedule and DeepSpeed's "auto"
// ------------------------------------------------------------------------------------------------

TrainSettings cli_train(const TrainFlags& flags, std::string_view config_text, cli::RunFacts run) {
  config::Config c = parse(config_text);
  return build_train_settings(flags, &c, 2, run);
}

// A Hugging Face style config: every "auto" takes a value from the run, as transformers'
// HfTrainerDeepSpeedConfig fills them in, and the start-up block and the log line say which.
TEST(Tunables, AutoValuesAreResolvedFromTheRunAndShown) {
  const std::string hf = R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
          "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
      "aio": {"queue_depth": "auto"}})";
  const TrainSettings s = cli_train(
      {{"--lr", {"0.02"}}, {"--grad-accum", {"3"}}, {"--batch", {"5"}}, {"--warmup-steps", {"7"}}},
      hf, {.hidden = 768, .steps = 120});
  EXPECT_EQ(s.batch, 5);
  EXPECT_EQ(s.engine.gradient_accumulation_steps, 3);
  EXPECT_EQ(s.config.train_batch_size, 5 * 3 * 2);
  EXPECT_EQ(s.engine.adam.lr, 0.02f);
  EXPECT_EQ(s.engine.gradient_clipping, *t::kGradientClipping.train);
  EXPECT_EQ(s.engine.reduce_bucket_elements, 768u * 768u);
  EXPECT_EQ(s.engine.prefetch_bucket_elements, 530841u);  // int(0.9 * 768^2 = 530841.6)
  EXPECT_EQ(s.engine.param_persistence_threshold, 7680u);
  EXPECT_EQ(s.engine.io_queue_depth, t::kIoQueueDepth.value) << "nothing in the run decides it";
  const config::SchedulerConfig& sc = s.config.scheduler;
  EXPECT_EQ(sc.type, config::SchedulerConfig::Type::kWarmupDecayLR);
  EXPECT_EQ(sc.total_num_steps, 120);
  EXPECT_EQ(sc.warmup_num_steps, 7);
  EXPECT_EQ(sc.warmup_max_lr, 0.02);
  EXPECT_EQ(sc.warmup_min_lr, 0.0);

  // Every "auto" is listed with its value and its origin; the table's entries say "auto".
  EXPECT_EQ(s.auto_values.size(), 14u);
  EXPECT_EQ(s.auto_values.at("zero_optimization.reduce_bucket_size").value, "589824");
  EXPECT_EQ(s.auto_values.at("zero_optimization.reduce_bucket_size").from, "hidden^2, hidden 768");
  EXPECT_EQ(s.auto_values.at("train_batch_size").value, "30");
  EXPECT_EQ(s.auto_values.at("scheduler.params.total_num_steps").from, "--steps");
  EXPECT_EQ(s.auto_values.at("scheduler.params.warmup_num_steps").from, "--warmup-steps");
  EXPECT_EQ(s.auto_values.at("aio.queue_depth").from, "its default: nothing in the run decides it");
  EXPECT_EQ(s.sources.at("reduce_bucket_elements"), Source::kAuto);
  EXPECT_EQ(s.sources.at("micro_batch"), Source::kFlag) << "a flag given is named as the flag";
  EXPECT_EQ(s.sources.at("warmup_num_steps"), Source::kFlag);
  const std::string block = cli::settings_block(s);
  EXPECT_THAT(block, HasSubstr("reduce_bucket_elements=589824 (auto: hidden^2, hidden 768)"));
  EXPECT_THAT(cli::settings_line(s),
              HasSubstr(" reduce_bucket_elements=589824 (auto: hidden^2, hidden 768)"));
  EXPECT_THAT(block, HasSubstr("param_persistence_threshold=7680 elements (auto: 10 hidden"));
  EXPECT_THAT(block, HasSubstr("io_queue_depth=8 (auto: its default: nothing in the run decides"));
  EXPECT_THAT(block, HasSubstr("lr schedule WarmupDecayLR:\n  total_num_steps=120"));
  EXPECT_THAT(block, HasSubstr("scheduler.params.warmup_max_lr=0.02 (the optimizer's lr)"));
  for (size_t start = 0, end; start < block.size(); start = end + 1) {
    end = block.find('\n', start);
    EXPECT_LE(end - start, 100u) << block.substr(start, end - start);
  }
  const json line = json::parse(cli::settings_log_line(s).dump());
  EXPECT_EQ(line["auto"]["zero_optimization.stage3_prefetch_bucket_size"],
            "530841 (0.9 hidden^2, hidden 768)");
  EXPECT_EQ(line["set_by"]["prefetch_bucket_elements"], "auto");
  EXPECT_EQ(line["scheduler"]["params"]["total_num_steps"], 120);

  // Without the model's hidden size (zinf estimate), the bucket sizes keep their defaults and
  // say so; without the run's length the schedule's "auto" is left to zinf train.
  const TrainSettings unknown = cli_train({}, hf, {});
  EXPECT_EQ(unknown.engine.reduce_bucket_elements, t::kReduceBucket.value);
  EXPECT_THAT(unknown.auto_values.at("zero_optimization.reduce_bucket_size").from,
              HasSubstr("the model's hidden size is not known"));
  EXPECT_FALSE(unknown.config.scheduler.total_num_steps.has_value());

  // A warm-up left "auto" with no --warmup-steps is an error naming the key and the flag.
  try {
    cli_train({}, hf, {.hidden = 768, .steps = 120});
    ADD_FAILURE() << "no error";
  } catch (const cli::CliError& e) {
    EXPECT_THAT(e.what(), HasSubstr("scheduler.params.warmup_num_steps is \"auto\""));
    EXPECT_THAT(e.what(), HasSubstr("--warmup-steps"));
  }
}

TEST(Tunables, ScheduleFlagsSetTheSchedulerBlock) {
  using Type = config::SchedulerConfig::Type;
  const TrainSettings plain = cli_run();
  EXPECT_EQ(plain.config.scheduler.type, Type::kNone);
  const TrainSettings cosine =
      cli_train({{"--lr-schedule", {"WarmupCosineLR"}}, {"--warmup-steps", {"10"}}}, "{}",
                {.hidden = 32, .steps = 50});
  EXPECT_EQ(cosine.config.scheduler.type, Type::kWarmupCosineLR);
  EXPECT_EQ(cosine.config.scheduler.warmup_num_steps, 10);
  EXPECT_EQ(cosine.config.scheduler.total_num_steps, 50) << "the run's --steps";
  EXPECT_EQ(cosine.sources.at("lr_schedule"), Source::kFlag);
  EXPECT_EQ(differences(cli_json(plain), cli_json(cosine)),
            (std::set<std::string>{"lr_schedule", "warmup_num_steps"}));
  // The flag overrides the config's type and keeps its parameters when the type accepts them.
  const TrainSettings decay = cli_train(
      {{"--lr-schedule", {"WarmupDecayLR"}}},
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.1}}})",
      {.steps = 9});
  EXPECT_EQ(decay.config.scheduler.type, Type::kWarmupDecayLR);
  EXPECT_EQ(decay.config.scheduler.warmup_num_steps, 4);
  EXPECT_EQ(decay.config.scheduler.warmup_max_lr, 0.1);
  EXPECT_EQ(cli_train({{"--lr-schedule", {"none"}}}, R"({"scheduler": {"type": "WarmupLR"}})",
                      {.steps = 9})
                .config.scheduler.type,
            Type::kNone);

  struct Bad {
    TrainFlags flags;
    const char* config;
    const char* message;
  };
  const Bad cases[] = {
      {{{"--lr-schedule", {"cosine"}}},
       "{}",
       "--lr-schedule must be none, WarmupLR, WarmupDecayLR"},
      {{{"--warmup-steps", {"5"}}},
       "{}",
       "--warmup-steps applies to WarmupLR, WarmupDecayLR and "
       "WarmupCosineLR; the schedule is none"},
      {{{"--lr-schedule", {"WarmupLR"}}, {"--warmup-steps", {"0"}}},
       "{}",
       "scheduler.params.warmup_num_steps (--warmup-steps): expected a positive integer, got 0"},
      {{{"--lr-schedule", {"OneCycle"}}}, "{}", "scheduler.params.cycle_min_lr: OneCycle requires"},
      {{{"--lr-schedule", {"OneCycle"}}},
       R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}})",
       "--lr-schedule OneCycle: the config's scheduler.params.warmup_num_steps is not a "
       "parameter of OneCycle"},
      {{{"--warmup-steps", {"3"}}},
       R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}}})",
       "the schedule is OneCycle"},
  };
  for (const Bad& bad : cases) {
    try {
      cli_train(bad.flags, bad.config, {.steps = 10});
      ADD_FAILURE() << "no error for " << bad.message;
    } catch (const cli::CliError& e) {
      EXPECT_THAT(e.what(), HasSubstr(bad.message));
      EXPECT_EQ(e.code, 2);
    }
  }
}

// The comparisons above would see a default written differently in one place.
TEST(Tunables, TheComparisonIsNotVacuous) {
  EngineSettings drifted;
  drifted.staging_bytes = 4ull << 20;  // the config reader's old default
  EXPECT_EQ(differences(settings_json(drifted), settings_json(EngineSettings{})),
            std::set<std::string>{"staging_bytes"});
  drifted = EngineSettings{};
  drifted.adam.weight_decay_mode = kernels::WeightDecayMode::kL2;
  drifted.device = DeviceKind::kCpuStrict;
  EXPECT_EQ(differences(settings_json(drifted), settings_json(EngineSettings{})),
            (std::set<std::string>{"adam.adam_w_mode", "device"}));
  // A table default the engine would not match.
  const t::Entry& queue_depth = *t::find("io_queue_depth");
  EXPECT_NE(settings_json(EngineSettings{}).at("io_queue_depth"),
            tunable_json(queue_depth, t::Value(uint64_t{32})));
}

// The start-up line names what is not left at the table's default, with its source, and nothing
// else (a value the config sets to the default's included).
TEST(Tunables, TheStartUpLineNamesWhatIsNotTheDefault) {
  const TrainSettings s = cli_run({{"--stage", {"2"}}, {"--host-mem", {"1G"}}},
                                  R"({"aio": {"queue_depth": 4}, "zinf": {"seed": 0}})");
  const std::string line = cli::settings_line(s);
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1) << line;
  EXPECT_EQ(line.back(), '\n');
  EXPECT_THAT(line, ::testing::StartsWith("settings "));
  EXPECT_THAT(line, HasSubstr(" stage=2 (flag) "));
  EXPECT_THAT(line, HasSubstr(" host_mem=1024 MiB (flag)"));
  EXPECT_THAT(line, HasSubstr(" io_queue_depth=4 (config)"));
  EXPECT_THAT(line, HasSubstr(" seed=0 (config)")) << "set by the config, at the default's value";
  EXPECT_THAT(line, HasSubstr(" adam.lr=0.003 (zinf train)"));
  EXPECT_THAT(line, HasSubstr(" micro_batch=8 (zinf train)"));
  size_t named = 0;
  for (const t::Entry& e : t::kAll) {
    const bool shown = line.find(" " + std::string(e.name) + "=") != std::string::npos;
    EXPECT_EQ(shown, s.sources.contains(e.name)) << e.name;
    named += shown;
  }
  EXPECT_EQ(named, s.sources.size());
  EXPECT_THAT(line, ::testing::Not(HasSubstr("device_mem=")));
  EXPECT_THAT(line, ::testing::Not(HasSubstr("adam.beta1=")));
}

TEST(Tunables, TheStartUpBlockAndTheLogLineNameEverySetting) {
  const TrainSettings s =
      cli_run({{"--stage", {"2"}}, {"--host-mem", {"1G"}}}, R"({"aio": {"queue_depth": 4}})");
  const std::string block = cli::settings_block(s);
  for (const t::Entry& e : t::kAll)
    EXPECT_THAT(block, HasSubstr(std::string(e.name) + "=")) << e.name;
  EXPECT_THAT(block, HasSubstr("stage=2 (flag)"));
  EXPECT_THAT(block, HasSubstr("host_mem=1024 MiB (flag)"));
  EXPECT_THAT(block, HasSubstr("device_mem=auto"));
  EXPECT_THAT(block, HasSubstr("io_queue_depth=4 (config)"));
  EXPECT_THAT(block, HasSubstr("adam.lr=0.003 (zinf train)"));
  EXPECT_THAT(block, HasSubstr("staging_bytes=2 MiB  "));
  for (size_t start = 0, end; start < block.size(); start = end + 1) {
    end = block.find('\n', start);
    EXPECT_LE(end - start, 100u) << block.substr(start, end - start);
  }

  const json line = json::parse(cli::settings_log_line(s).dump());
  ASSERT_TRUE(line.contains("settings"));
  EXPECT_EQ(line["settings"].size(), t::kAll.size());
  EXPECT_EQ(line["settings"]["stage"], 2);
  EXPECT_EQ(line["set_by"]["stage"], "flag");
  EXPECT_EQ(line["set_by"]["io_queue_depth"], "config");
  EXPECT_FALSE(line["set_by"].contains("staging_bytes"));
  EXPECT_EQ(cli::settings_log_line(s).begin().key(), "settings") << "the first key of the line";
}

}  // namespace
}  // namespace zinf
