#include "train_settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>

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

config::OffloadDevice offload_flag(const char* flag, const std::string& v) {
  std::optional<config::OffloadDevice> d = config::parse_offload_device(v);
  if (!d) throw CliError(fmt::format("{} must be none, cpu or nvme, got '{}'", flag, v), 2);
  return *d;
}

// A rule of zinf/core/validate.h, failed: a CliError (exit code 2) with its message.
void check(const Status& s) {
  if (!s.is_ok()) throw CliError(s.message(), 2);
}

// A budget flag: a positive size (validate::explicit_budget).
uint64_t budget_flag(const t::Entry& e, const std::string& text) {
  const uint64_t bytes = bytes_flag(std::string(e.flag).c_str(), text);
  check(validate::explicit_budget(e, bytes));
  return bytes;
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
  if (f.lr_schedule) {
    std::optional<SchedType> t = config::parse_scheduler_type(*f.lr_schedule);
    if (!t) {
      throw CliError(fmt::format("--lr-schedule must be none, WarmupLR, WarmupDecayLR, "
                                 "WarmupCosineLR or OneCycle (DeepSpeed's names), got '{}'",
                                 *f.lr_schedule),
                     2);
    }
    if (*t != SchedType::kNone && *t != c.scheduler.type) {
      const auto accepted = config::scheduler_params(*t);
      for (const std::string& key : c.given_keys) {
        if (!key.starts_with("scheduler.params.")) continue;
        std::string_view name = std::string_view(key).substr(17);
        if (std::find(accepted.begin(), accepted.end(), name) == accepted.end()) {
          throw CliError(fmt::format("--lr-schedule {}: the config's {} is not a parameter of {}",
                                     *f.lr_schedule, key, *f.lr_schedule),
                         2);
        }
      }
    }
    c.scheduler.type = *t;
  }
  if (f.warmup_steps) {
    if (*f.warmup_steps < 1) throw CliError("--warmup-steps must be >= 1", 2);
    const auto accepted = config::scheduler_params(c.scheduler.type);
    if (std::find(accepted.begin(), accepted.end(), "warmup_num_steps") == accepted.end()) {
      throw CliError(fmt::format("--warmup-steps applies to WarmupLR, WarmupDecayLR and "
                                 "WarmupCosineLR; the schedule is {} (--lr-schedule or the "
                                 "config's scheduler.type)",
                                 config::scheduler_type_name(c.scheduler.type)),
                     2);
    }
    c.scheduler.warmup_num_steps = *f.warmup_steps;
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
      from = f.batch ? "--batch" : "zinf train's micro batch; --batch sets it";
    } else if (path == "gradient_accumulation_steps") {
      from = f.grad_accum                                 ? "--grad-accum"
             : config::config_sets(c, "train_batch_size") ? "derived from train_batch_size"
                                                          : "1: no --grad-accum";
    } else if (path == "train_batch_size") {
      from = "micro batch x accumulation steps x world size";
    } else if (path == "gradient_clipping") {
      from = f.clip ? "--clip" : "zinf train's clipping; --clip sets it";
    } else if (path == "optimizer.params.lr") {
      from = f.lr ? "--lr" : "zinf train's lr; --lr sets it";
    } else if (path == "optimizer.params.betas" || path == "optimizer.params.eps" ||
               path == "optimizer.params.weight_decay") {
      from = "zinf train's value; no flag sets it";
    } else if (path == "fp16.enabled" || path == "bf16.enabled" || path == "bfloat16.enabled") {
      from = f.dtype ? "--dtype " + *f.dtype : "fp32: no --dtype";
    } else if (path == "zero_optimization.reduce_bucket_size") {
      if (h == 0) {
        from = hidden_unknown;
      } else {
        c.zero.reduce_bucket_size = h * h;
        from = fmt::format("hidden^2, hidden {}", h);
      }
    } else if (path == "zero_optimization.stage3_prefetch_bucket_size" ||
               path == "zero_optimization.prefetch_bucket_size") {
      if (f.prefetch_bucket) {
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
      if (f.warmup_steps) {
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
  if (!sets(entry(t::kStage.name))) c.zero.stage = *t::kStage.train;
  if (!sets(entry(t::kMicroBatch.name))) {
    c.train_micro_batch_size_per_gpu = *t::kMicroBatch.train;
  }
  if (!sets(entry(t::kGradientClipping.name))) c.gradient_clipping = *t::kGradientClipping.train;
  if (!sets(entry(t::kLr.name))) c.optimizer.lr = *t::kLr.train;
  if (!sets(entry(t::kWeightDecay.name))) c.optimizer.weight_decay = *t::kWeightDecay.train;
  if (!sets(entry(t::kSeed.name))) c.zinf.seed = *t::kSeed.train;
  if (!sets(entry(t::kPipelineRead.name))) {
    c.zero.offload_optimizer.pipeline_read = *t::kPipelineRead.train;
  }
  if (!sets(entry(t::kPipelineWrite.name))) {
    c.zero.offload_optimizer.pipeline_write = *t::kPipelineWrite.train;
  }

  // The flags, onto the keys they stand for.
  if (f.stage) {
    check(validate::stage(*f.stage));
    c.zero.stage = *f.stage;
  }
  if (f.dtype) {
    std::optional<DType> dt = parse_dtype(*f.dtype);
    if (!dt) throw CliError("--dtype must be fp32, bf16 or fp16, got '" + *f.dtype + "'", 2);
    c.fp16.enabled = *dt == DType::kF16;
    c.bf16 = *dt == DType::kBF16;
  }
  if (f.lr) c.optimizer.lr = static_cast<float>(*f.lr);
  if (f.clip) c.gradient_clipping = static_cast<float>(*f.clip);
  if (f.grad_accum) {
    check(validate::positive(*entry(t::kGradientAccumulationSteps.name), *f.grad_accum));
    c.gradient_accumulation_steps = *f.grad_accum;
  }
  if (f.batch) {
    check(validate::positive(*entry(t::kMicroBatch.name), *f.batch));
    c.train_micro_batch_size_per_gpu = *f.batch;
  }
  if (f.seed) c.zinf.seed = *f.seed;
  if (f.offload_param) {
    c.zero.offload_param.device = offload_flag("--offload-param", *f.offload_param);
  }
  if (f.offload_optimizer) {
    c.zero.offload_optimizer.device = offload_flag("--offload-optimizer", *f.offload_optimizer);
  }
  if (!f.nvme_paths.empty()) {
    c.zero.offload_param.nvme_path = f.nvme_paths;
    c.zero.offload_optimizer.nvme_path = f.nvme_paths;
  }
  if (f.prefetch_bucket) {
    c.zero.stage3_prefetch_bucket_size = elements_flag("--prefetch-bucket", *f.prefetch_bucket);
  }
  if (f.max_live) c.zero.stage3_max_live_parameters = elements_flag("--max-live", *f.max_live);
  if (f.reuse_distance) {
    c.zero.stage3_max_reuse_distance = elements_flag("--reuse-distance", *f.reuse_distance);
  }
  if (f.sub_group) c.zero.sub_group_size = elements_flag("--sub-group", *f.sub_group);
  if (f.overlap_optimizer) c.zinf.overlap_optimizer = true;
  if (f.device_mem) c.zinf.device_mem = budget_flag(*entry(t::kDeviceMem.name), *f.device_mem);
  if (f.host_mem) c.zinf.host_mem = budget_flag(*entry(t::kHostMem.name), *f.host_mem);
  if (f.trace) c.zinf.trace = *f.trace;
  if (f.no_checksum) c.zinf.checksum = false;
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
  if (f.device) {
    const auto kind = parse_device_kind(*f.device);
    if (!kind) {
      throw CliError(
          fmt::format("--device must be auto, cpu, cpu-strict or cuda, got '{}'", *f.device), 2);
    }
    out.engine.device = *kind;
  }
  out.batch = static_cast<int>(c.train_micro_batch_size_per_gpu);
  out.seed = c.zinf.seed;
  out.trace = c.zinf.trace;

  // Where each value came from.
  const std::map<std::string_view, bool> flag_given = {
      {"--stage", f.stage.has_value()},
      {"--dtype", f.dtype.has_value()},
      {"--lr", f.lr.has_value()},
      {"--clip", f.clip.has_value()},
      {"--grad-accum", f.grad_accum.has_value()},
      {"--batch", f.batch.has_value()},
      {"--seed", f.seed.has_value()},
      {"--offload-param", f.offload_param.has_value()},
      {"--offload-optimizer", f.offload_optimizer.has_value()},
      {"--nvme-path", !f.nvme_paths.empty()},
      {"--prefetch-bucket", f.prefetch_bucket.has_value()},
      {"--max-live", f.max_live.has_value()},
      {"--reuse-distance", f.reuse_distance.has_value()},
      {"--sub-group", f.sub_group.has_value()},
      {"--device-mem", f.device_mem.has_value()},
      {"--host-mem", f.host_mem.has_value()},
      {"--overlap-optimizer", f.overlap_optimizer},
      {"--trace", f.trace.has_value()},
      {"--no-checksum", f.no_checksum},
      {"--lr-schedule", f.lr_schedule.has_value()},
      {"--warmup-steps", f.warmup_steps.has_value()},
      {"--device", f.device.has_value()},
  };
  for (const t::Entry& e : t::kAll) {
    Source s = Source::kDefault;
    if (auto it = flag_given.find(e.flag);
        !e.flag.empty() && it != flag_given.end() && it->second) {
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
