#include "train_settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <type_traits>
#include <variant>

#include "command.h"
#include "zinf/core/units.h"
#include "zinf/core/validate.h"
#include "zinf/optim/lr_schedule.h"

namespace zinf::cli {
namespace {

namespace t = tunables;

// Whether the config sets one of the JSON keys of `e` (its ", "-separated paths).
bool config_sets_entry(const config::Config* cfg, const t::Entry& e) {
  if (cfg == nullptr) return false;
  std::string_view paths = e.json;
  while (!paths.empty()) {
    size_t comma = paths.find(',');
    std::string_view path = paths.substr(0, comma);
    if (!path.empty() && config::config_sets(*cfg, path)) return true;
    if (comma == std::string_view::npos) break;
    paths.remove_prefix(comma + 1);
    while (!paths.empty() && paths.front() == ' ') paths.remove_prefix(1);
  }
  // DeepSpeed derives the micro batch from train_batch_size when only that is given.
  if (e.name == t::kMicroBatch.name) return config::config_sets(*cfg, "train_batch_size");
  return false;
}

// A rule of zinf/core/validate.h, failed: a CliError (exit code 2) with its message.
void check(const Status& s) {
  if (!s.is_ok()) throw CliError(s.message(), 2);
}

// The last text given to a flag (a flag given twice is refused by CLI11, a list's flag repeats).
const std::string& text_of(const TrainFlags& f, std::string_view flag) {
  return f.find(flag)->second.back();
}

// A number given to `flag`: the whole text, or a CliError naming the flag.
template <class T>
T number_flag(std::string_view flag, const std::string& text) {
  T v{};
  const char* end = text.data() + text.size();
  if constexpr (std::is_floating_point_v<T>) {
    char* stop = nullptr;
    v = static_cast<T>(std::strtod(text.c_str(), &stop));
    if (!text.empty() && stop == end) return v;
    throw CliError(fmt::format("{}: expected a number, got '{}'", flag, text), 2);
  } else {
    auto [stop, ec] = std::from_chars(text.data(), end, v);
    if (ec == std::errc() && stop == end) return v;
    throw CliError(fmt::format("{}: expected {}an integer, got '{}'", flag,
                               std::is_signed_v<T> ? "" : "a non-negative ", text),
                   2);
  }
}

// A field of config::Config that an entry's JSON key sets.
using FieldRef = std::variant<int*, int64_t*, uint64_t*, float*, double*, bool*, std::string*,
                              config::OffloadDevice*, std::vector<std::string>*>;

// The field(s) behind each entry `zinf train` sets, by a flag or by its own default: a flag means
// exactly what its JSON key means. The entries whose flag means more than one key's value (dtype,
// lr_schedule, warmup_num_steps) or no key at all (device) are applied in build_train_settings.
struct ConfigField {
  std::string_view name;
  std::vector<FieldRef> (*fields)(config::Config& c);
};
const ConfigField kConfigFields[] = {
    {t::kStage.name, [](config::Config& c) -> std::vector<FieldRef> { return {&c.zero.stage}; }},
    {t::kMicroBatch.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.train_micro_batch_size_per_gpu};
     }},
    {t::kGradientAccumulationSteps.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.gradient_accumulation_steps}; }},
    {t::kGradientClipping.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.gradient_clipping}; }},
    {t::kLr.name, [](config::Config& c) -> std::vector<FieldRef> { return {&c.optimizer.lr}; }},
    {t::kWeightDecay.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.optimizer.weight_decay}; }},
    {t::kSubGroup.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zero.sub_group_size}; }},
    {t::kPrefetchBucket.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.stage3_prefetch_bucket_size};
     }},
    {t::kMaxLive.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.stage3_max_live_parameters};
     }},
    {t::kMaxReuseDistance.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.stage3_max_reuse_distance};
     }},
    {t::kParamHome.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zero.offload_param.device}; }},
    {t::kOptimizerHome.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zero.offload_optimizer.device}; }},
    {t::kNvmePaths.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.offload_param.nvme_path, &c.zero.offload_optimizer.nvme_path};
     }},
    {t::kPipelineRead.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.offload_optimizer.pipeline_read};
     }},
    {t::kPipelineWrite.name,
     [](config::Config& c) -> std::vector<FieldRef> {
       return {&c.zero.offload_optimizer.pipeline_write};
     }},
    {t::kDeviceMem.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.device_mem}; }},
    {t::kHostMem.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.host_mem}; }},
    {t::kOverlapOptimizer.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.overlap_optimizer}; }},
    {t::kChecksum.name,
     [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.checksum}; }},
    {t::kSeed.name, [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.seed}; }},
    {t::kTrace.name, [](config::Config& c) -> std::vector<FieldRef> { return {&c.zinf.trace}; }},
};

const ConfigField* config_field(std::string_view name) {
  for (const ConfigField& f : kConfigFields) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// Sets `field` to a table value (zinf train's own default).
void set_value(const FieldRef& field, const t::Value& value) {
  std::visit(
      [&](auto* out) {
        using F = std::remove_pointer_t<decltype(out)>;
        std::visit(
            [&](const auto& v) {
              using V = std::decay_t<decltype(v)>;
              if constexpr (std::is_arithmetic_v<F> && std::is_arithmetic_v<V>) {
                *out = static_cast<F>(v);
              } else if constexpr (std::is_same_v<F, std::string> &&
                                   std::is_same_v<V, std::string_view>) {
                *out = std::string(v);
              } else {
                throw std::logic_error("a zinf train value of another type than its field");
              }
            },
            value);
      },
      field);
}

// Sets `field` from the text given to the entry's flag: a switch sets a bool to the other value
// than the table's; sizes read as the unit says (2G for bytes, 5e7 for elements). A count or a
// budget given explicitly must be positive (validate.h).
void set_from_flag(const FieldRef& field, const t::Entry& e,
                   const std::vector<std::string>& given) {
  const std::string flag(e.flag);
  std::visit(
      [&](auto* out) {
        using F = std::remove_pointer_t<decltype(out)>;
        if constexpr (std::is_same_v<F, bool>) {
          *out = !std::get<bool>(e.value);
        } else if constexpr (std::is_same_v<F, std::vector<std::string>>) {
          *out = given;
        } else if constexpr (std::is_same_v<F, std::string>) {
          *out = given.back();
        } else if constexpr (std::is_same_v<F, config::OffloadDevice>) {
          std::optional<config::OffloadDevice> d = config::parse_offload_device(given.back());
          if (!d) {
            throw CliError(fmt::format("{}: expected none, cpu or nvme, got '{}'",
                                       validate::label(e), given.back()),
                           2);
          }
          *out = *d;
        } else if constexpr (std::is_same_v<F, uint64_t>) {
          *out = e.unit == t::Unit::kBytes      ? bytes_flag(flag, given.back())
                 : e.unit == t::Unit::kElements ? elements_flag(flag, given.back())
                                                : number_flag<uint64_t>(flag, given.back());
          if (e.unit == t::Unit::kBytes) check(validate::explicit_budget(e, *out));
        } else {
          *out = number_flag<F>(flag, given.back());
          if constexpr (std::is_integral_v<F>) {
            if (e.unit == t::Unit::kCount || e.unit == t::Unit::kSteps) {
              check(validate::positive(e, *out));
            }
          }
        }
      },
      field);
}

// The "auto" note of the first of `e`'s JSON paths the config gave as "auto", or nullptr.
const TrainSettings::AutoValue* auto_note(const TrainSettings& s, const t::Entry& e) {
  std::string_view paths = e.json;
  while (!paths.empty()) {
    size_t comma = paths.find(',');
    std::string_view path = paths.substr(0, comma);
    if (auto it = s.auto_values.find(path); it != s.auto_values.end()) return &it->second;
    if (comma == std::string_view::npos) break;
    paths.remove_prefix(comma + 1);
    while (!paths.empty() && paths.front() == ' ') paths.remove_prefix(1);
  }
  return nullptr;
}

using SchedType = config::SchedulerConfig::Type;

// --lr-schedule and --warmup-steps onto the scheduler block. A type the flag changes to must
// accept every parameter the config gives (as DeepSpeed's constructors would).
void apply_schedule_flags(const TrainFlags& f, config::Config& c) {
  const std::string_view schedule_flag = t::kLrSchedule.flag, warmup_flag = t::kWarmupSteps.flag;
  if (f.contains(schedule_flag)) {
    const std::string& schedule = text_of(f, schedule_flag);
    std::optional<SchedType> t = config::parse_scheduler_type(schedule);
    if (!t) {
      throw CliError(fmt::format("--lr-schedule must be none, WarmupLR, WarmupDecayLR, "
                                 "WarmupCosineLR or OneCycle (DeepSpeed's names), got '{}'",
                                 schedule),
                     2);
    }
    if (*t != SchedType::kNone && *t != c.scheduler.type) {
      const auto accepted = config::scheduler_params(*t);
      for (const std::string& key : c.given_keys) {
        if (!key.starts_with("scheduler.params.")) continue;
        std::string_view name = std::string_view(key).substr(17);
        if (std::find(accepted.begin(), accepted.end(), name) == accepted.end()) {
          throw CliError(fmt::format("--lr-schedule {}: the config's {} is not a parameter of {}",
                                     schedule, key, schedule),
                         2);
        }
      }
    }
    c.scheduler.type = *t;
  }
  if (f.contains(warmup_flag)) {
    const auto warmup_steps = number_flag<int64_t>(warmup_flag, text_of(f, warmup_flag));
    check(validate::positive(*t::find(t::kWarmupSteps.name), warmup_steps));
    const auto accepted = config::scheduler_params(c.scheduler.type);
    if (std::find(accepted.begin(), accepted.end(), "warmup_num_steps") == accepted.end()) {
      throw CliError(fmt::format("--warmup-steps applies to WarmupLR, WarmupDecayLR and "
                                 "WarmupCosineLR; the schedule is {} (--lr-schedule or the "
                                 "config's scheduler.type)",
                                 config::scheduler_type_name(c.scheduler.type)),
                     2);
    }
    c.scheduler.warmup_num_steps = warmup_steps;
  }
}

// DeepSpeed's "auto": each key the config gives as "auto" takes a value from the run, as the
// Hugging Face integration fills them in (transformers' HfTrainerDeepSpeedConfig), and says where
// it came from; a key nothing in the run decides keeps its default and says so. Fills
// `notes` (JSON path -> origin) and sets the values that are not already the run's (the batch
// sizes, lr, clipping and precision are: "auto" leaves them to zinf train's flags and defaults).
void resolve_auto(const TrainFlags& f, const RunFacts& run, config::Config& c,
                  std::map<std::string, TrainSettings::AutoValue, std::less<>>& notes) {
  const uint64_t h = static_cast<uint64_t>(std::max<int64_t>(0, run.hidden));
  const std::string hidden_unknown = "its default: the model's hidden size is not known here";
  for (const std::string& path : c.auto_keys) {
    std::string from;
    if (path == "train_micro_batch_size_per_gpu") {
      from = f.contains("--batch") ? "--batch" : "zinf train's micro batch; --batch sets it";
    } else if (path == "gradient_accumulation_steps") {
      from = f.contains("--grad-accum")                   ? "--grad-accum"
             : config::config_sets(c, "train_batch_size") ? "derived from train_batch_size"
                                                          : "1: no --grad-accum";
    } else if (path == "train_batch_size") {
      from = "micro batch x accumulation steps x world size";
    } else if (path == "gradient_clipping") {
      from = f.contains("--clip") ? "--clip" : "zinf train's clipping; --clip sets it";
    } else if (path == "optimizer.params.lr") {
      from = f.contains("--lr") ? "--lr" : "zinf train's lr; --lr sets it";
    } else if (path == "optimizer.params.betas" || path == "optimizer.params.eps" ||
               path == "optimizer.params.weight_decay") {
      from = "zinf train's value; no flag sets it";
    } else if (path == "fp16.enabled" || path == "bf16.enabled" || path == "bfloat16.enabled") {
      from = f.contains("--dtype") ? "--dtype " + text_of(f, "--dtype") : "fp32: no --dtype";
    } else if (path == "zero_optimization.reduce_bucket_size") {
      if (h == 0) {
        from = hidden_unknown;
      } else {
        c.zero.reduce_bucket_size = h * h;
        from = fmt::format("hidden^2, hidden {}", h);
      }
    } else if (path == "zero_optimization.stage3_prefetch_bucket_size" ||
               path == "zero_optimization.prefetch_bucket_size") {
      if (f.contains("--prefetch-bucket")) {
        from = "--prefetch-bucket";
      } else if (h == 0) {
        from = hidden_unknown;
      } else {
        c.zero.stage3_prefetch_bucket_size =
            static_cast<uint64_t>(0.9 * static_cast<double>(h * h));
        from = fmt::format("0.9 hidden^2, hidden {}", h);
      }
    } else if (path == "zero_optimization.stage3_param_persistence_threshold" ||
               path == "zero_optimization.param_persistence_threshold") {
      if (h == 0) {
        from = hidden_unknown;
      } else {
        c.zero.stage3_param_persistence_threshold = 10 * h;
        from = fmt::format("10 hidden, hidden {}", h);
      }
    } else if (path == "scheduler.params.warmup_num_steps") {
      if (f.contains("--warmup-steps")) {
        from = "--warmup-steps";
      } else if (run.steps) {
        throw CliError(
            "scheduler.params.warmup_num_steps is \"auto\": give the warm-up with --warmup-steps "
            "N (or a number in the config)",
            2);
      } else {
        from = "unresolved: zinf train takes it from --warmup-steps";
      }
    } else if (path == "scheduler.params.total_num_steps") {
      if (run.steps) {
        c.scheduler.total_num_steps = *run.steps;
        from = "--steps";
      } else {
        from = "unresolved: zinf train takes it from --steps";
      }
    } else if (path == "scheduler.params.warmup_max_lr") {
      // The lr as written (0.02, not the float's 0.019999999552965164), as HF passes it.
      c.scheduler.warmup_max_lr = std::strtod(fmt::format("{}", c.optimizer.lr).c_str(), nullptr);
      from = "the optimizer's lr";
    } else if (path == "scheduler.params.warmup_min_lr") {
      c.scheduler.warmup_min_lr = 0;
      from = "0, as the Hugging Face integration sets it";
    } else if (path.starts_with("scheduler.params.")) {
      if (run.steps) {
        throw CliError(fmt::format("{} is \"auto\", which nothing in the run decides; give a "
                                   "number in the config",
                                   path),
                       2);
      }
      from = "unresolved";
    } else {
      from = "its default: nothing in the run decides it";
    }
    notes[path] = {.from = std::move(from)};
  }
}

// The value at JSON path `path` of `j` as text, or "auto" when `j` does not hold it.
std::string value_at(const nlohmann::json& j, std::string_view path) {
  std::string pointer = "/" + std::string(path);
  std::replace(pointer.begin(), pointer.end(), '.', '/');
  const nlohmann::json::json_pointer ptr(pointer);
  if (!j.contains(ptr)) return "auto";
  return j.at(ptr).dump();
}

// The value of `v` as the start-up block prints it.
std::string value_text(const t::Entry& e, const nlohmann::ordered_json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    return s.empty() ? "\"\"" : s;
  }
  if (v.is_array()) {
    std::string joined;
    for (const auto& item : v) joined += (joined.empty() ? "" : ",") + item.get<std::string>();
    return joined.empty() ? "none" : joined;
  }
  if (e.unit == t::Unit::kBytes && v.is_number_unsigned()) {
    uint64_t bytes = v.get<uint64_t>();
    if (bytes == 0 && (e.name == t::kDeviceMem.name || e.name == t::kHostMem.name)) return "auto";
    if (bytes % (1ull << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
    return fmt::format("{} B", bytes);
  }
  std::string text = v.dump();
  // A unit the name does not already say.
  if (e.unit == t::Unit::kElements && e.name.find("elements") == std::string_view::npos) {
    text += " elements";
  }
  return text;
}

}  // namespace

namespace {

// A flag's help: the entry's doc, its JSON key and what leaving the flag out means.
std::string flag_help(const t::Entry& e) {
  std::string doc(e.doc);
  doc[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(doc[0])));
  const std::string_view key = e.json.empty() ? std::string_view() : e.json;
  if (const bool* on = std::get_if<bool>(&e.value)) {
    return fmt::format("{} (sets {} {}; default {})", doc, key, *on ? "false" : "true",
                       *on ? "true" : "false");
  }
  std::string def = t::to_string(e.train ? *e.train : e.value);
  if (e.unit == t::Unit::kBytes && e.value == t::Value(uint64_t{0})) def = "auto";
  if (e.list && e.value == t::Value(std::string_view())) def = "none";
  if (key.empty()) return fmt::format("{} (default {})", doc, def);
  return fmt::format("{} ({}; default {})", doc, key, def);
}

}  // namespace

void TrainFlagOptions::add_to(CLI::App& sub) {
  app_ = &sub;
  for (const t::Entry& e : t::kAll) {
    if (e.flag.empty()) continue;
    const std::string flag(e.flag);
    Storage& store = storage_[flag];
    if (std::holds_alternative<bool>(e.value)) {
      sub.add_flag(flag, store.on, flag_help(e));
    } else if (e.list) {
      sub.add_option(flag, store.list, flag_help(e))->type_name("DIR");
    } else {
      const bool number = !std::holds_alternative<std::string_view>(e.value);
      const char* type = e.unit == t::Unit::kBytes ? "SIZE" : number ? "NUMBER" : "TEXT";
      sub.add_option(flag, store.text, flag_help(e))->type_name(type);
    }
  }
}

TrainFlags TrainFlagOptions::given() const {
  TrainFlags out;
  for (const auto& [flag, store] : storage_) {
    if (app_ == nullptr || app_->count(flag) == 0) continue;
    if (!store.list.empty()) {
      out[flag] = store.list;
    } else if (store.on) {
      out[flag] = {};
    } else {
      out[flag] = {store.text};
    }
  }
  return out;
}

std::string_view source_name(Source s) {
  switch (s) {
    case Source::kDefault:
      return "default";
    case Source::kTrain:
      return "zinf train";
    case Source::kStageRule:
      return "stage rule";
    case Source::kConfig:
      return "config";
    case Source::kFlag:
      return "flag";
    case Source::kAuto:
      return "auto";
  }
  return "default";
}

TrainSettings build_train_settings(const TrainFlags& f, const config::Config* cfg, int world,
                                   const RunFacts& run) {
  TrainSettings out;
  config::Config& c = out.config;
  c = cfg != nullptr ? *cfg : config::Config{};
  auto sets = [&](const t::Entry* e) { return e != nullptr && config_sets_entry(cfg, *e); };
  auto entry = [](std::string_view name) { return t::find(name); };

  // zinf train's own defaults, for the keys the config leaves out.
  for (const t::Entry& e : t::kAll) {
    if (!e.train || sets(&e)) continue;
    for (const FieldRef& field : config_field(e.name)->fields(c)) set_value(field, *e.train);
  }

  // The flags, onto the keys they stand for.
  for (const t::Entry& e : t::kAll) {
    const auto given = f.find(e.flag);
    if (e.flag.empty() || given == f.end()) continue;
    if (const ConfigField* field = config_field(e.name)) {
      for (const FieldRef& ref : field->fields(c)) set_from_flag(ref, e, given->second);
    }
  }
  if (f.contains(t::kDtype.flag)) {
    const std::string& text = text_of(f, t::kDtype.flag);
    std::optional<DType> dt = parse_dtype(text);
    if (!dt) {
      throw CliError(fmt::format("--dtype must be fp32, bf16 or fp16, got '{}'", text), 2);
    }
    c.fp16.enabled = *dt == DType::kF16;
    c.bf16 = *dt == DType::kBF16;
  }
  apply_schedule_flags(f, c);
  resolve_auto(f, run, c, out.auto_values);
  // A decaying schedule that --lr-schedule named without its length: the run's.
  if ((c.scheduler.type == SchedType::kWarmupDecayLR ||
       c.scheduler.type == SchedType::kWarmupCosineLR) &&
      !c.scheduler.total_num_steps && run.steps) {
    c.scheduler.total_num_steps = *run.steps;
  }

  // DeepSpeed's rule for an absent overlap_comm, applied to the stage in the end.
  const bool overlap_rule = !sets(entry(t::kOverlapComm.name));
  if (overlap_rule) c.zero.overlap_comm = t::overlap_comm_for_stage(c.zero.stage);

  // The combinations (validate.h's rules, whose errors name the flags and the keys).
  if (Status s = config::resolve_batch_sizes(c, world); !s.is_ok()) throw CliError(s.detail(), 2);
  Result<EngineSettings> e = settings_from_config(c);
  if (!e.is_ok()) throw CliError(e.status().detail(), 2);
  if (run.steps) {  // the schedule zinf train will run: every parameter it needs is known now
    if (Status s = optim::LrSchedule::create(c.scheduler, c.optimizer.lr).status(); !s.is_ok()) {
      throw CliError(s.detail(), 2);
    }
  }
  const nlohmann::json effective = config::to_json(c);
  for (auto& [path, resolved] : out.auto_values) {
    std::string canonical = path == "bfloat16.enabled" ? "bf16.enabled" : path;
    if (canonical == "zero_optimization.prefetch_bucket_size" ||
        canonical == "zero_optimization.param_persistence_threshold") {
      canonical = "zero_optimization.stage3_" + canonical.substr(18);
    }
    resolved.value = value_at(effective, canonical);
  }
  out.engine = *e;
  if (f.contains(t::kDevice.flag)) {
    const std::string& text = text_of(f, t::kDevice.flag);
    const auto kind = parse_device_kind(text);
    if (!kind) {
      throw CliError(fmt::format("--device must be auto, cpu, cpu-strict or cuda, got '{}'", text),
                     2);
    }
    out.engine.device = *kind;
  }
  out.batch = static_cast<int>(c.train_micro_batch_size_per_gpu);
  out.seed = c.zinf.seed;
  out.trace = c.zinf.trace;

  // Where each value came from.
  for (const t::Entry& e : t::kAll) {
    Source s = Source::kDefault;
    if (!e.flag.empty() && f.contains(e.flag)) {
      s = Source::kFlag;
    } else if (auto_note(out, e) != nullptr) {
      s = Source::kAuto;
    } else if (sets(&e)) {
      s = Source::kConfig;
    } else if (e.train) {
      s = Source::kTrain;
    } else if (e.name == t::kOverlapComm.name && overlap_rule &&
               c.zero.overlap_comm != t::kOverlapComm.value) {
      s = Source::kStageRule;
    }
    if (s != Source::kDefault) out.sources.emplace(std::string(e.name), s);
  }
  return out;
}

nlohmann::ordered_json effective_settings_json(const TrainSettings& s) {
  nlohmann::json engine = settings_json(s.engine);
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const t::Entry& e : t::kAll) {
    const std::string name(e.name);
    if (e.reader == t::Reader::kEngine) {
      j[name] = engine.at(name);
    } else if (e.name == t::kOptimizerType.name) {
      j[name] = config::optimizer_type_name(s.config.optimizer.type);
    } else if (e.name == t::kParamBufferCount.name) {
      j[name] = s.config.zero.offload_param.buffer_count;
    } else if (e.name == t::kMicroBatch.name) {
      j[name] = s.batch;
    } else if (e.name == t::kTrace.name) {
      j[name] = s.trace;
    } else if (e.name == t::kLrSchedule.name) {
      j[name] = config::scheduler_type_name(s.config.scheduler.type);
    } else if (e.name == t::kWarmupSteps.name) {
      j[name] = s.config.scheduler.warmup_num_steps;
    }
  }
  return j;
}

nlohmann::ordered_json settings_log_line(const TrainSettings& s) {
  nlohmann::ordered_json set_by = nlohmann::ordered_json::object();
  for (const auto& [name, source] : s.sources) set_by[name] = source_name(source);
  nlohmann::ordered_json line;
  line["settings"] = effective_settings_json(s);
  line["set_by"] = std::move(set_by);
  if (!s.auto_values.empty()) {
    nlohmann::ordered_json autos = nlohmann::ordered_json::object();
    for (const auto& [path, resolved] : s.auto_values) {
      autos[path] = fmt::format("{} ({})", resolved.value, resolved.from);
    }
    line["auto"] = std::move(autos);
  }
  const nlohmann::json effective = config::to_json(s.config);
  if (effective.contains("scheduler")) line["scheduler"] = effective["scheduler"];
  return line;
}

std::string settings_line(const TrainSettings& s) {
  nlohmann::ordered_json values = effective_settings_json(s);
  std::string out = "settings not left at the table's default (--show-settings: all):";
  for (const t::Entry& e : t::kAll) {
    auto it = s.sources.find(e.name);
    if (it == s.sources.end()) continue;
    const TrainSettings::AutoValue* a = auto_note(s, e);
    out += fmt::format(" {}={} ({})", e.name, value_text(e, values[std::string(e.name)]),
                       it->second == Source::kAuto && a != nullptr
                           ? fmt::format("auto: {}", a->from)
                           : std::string(source_name(it->second)));
  }
  return out + "\n";
}

std::string settings_block(const TrainSettings& s, size_t width) {
  nlohmann::ordered_json values = effective_settings_json(s);
  // At most 100 columns, as the lines below.
  std::string out =
      "settings (unmarked: the table's default; zinf train: its own; docs/configuration.md):\n";
  const std::string indent = "  ";
  std::string line;
  auto flush = [&] {
    if (!line.empty()) out += indent + line + "\n";
    line.clear();
  };
  auto add = [&](const std::string& token) {
    if (!line.empty() && indent.size() + line.size() + 2 + token.size() > width) flush();
    line += (line.empty() ? "" : "  ") + token;
  };
  for (const t::Entry& e : t::kAll) {
    std::string token = fmt::format("{}={}", e.name, value_text(e, values[std::string(e.name)]));
    if (auto it = s.sources.find(e.name); it != s.sources.end()) {
      const TrainSettings::AutoValue* a = auto_note(s, e);
      token += it->second == Source::kAuto && a != nullptr
                   ? fmt::format(" (auto: {})", a->from)
                   : fmt::format(" ({})", source_name(it->second));
    }
    add(token);
  }
  flush();
  // The schedule's parameters, and every "auto" with what it resolved to and from what.
  const nlohmann::json effective = config::to_json(s.config);
  if (effective.contains("scheduler")) {
    out += "lr schedule " + effective["scheduler"]["type"].get<std::string>() + ":\n";
    for (const auto& [key, value] : effective["scheduler"]["params"].items()) {
      add(fmt::format("{}={}", key, value.dump()));
    }
    flush();
  }
  if (!s.auto_values.empty()) {
    out += "\"auto\" in the config, resolved from this run:\n";
    for (const auto& [path, resolved] : s.auto_values) {
      add(fmt::format("{}={} ({})", path, resolved.value, resolved.from));
    }
    flush();
  }
  return out;
}

}  // namespace zinf::cli
