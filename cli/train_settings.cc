#include "train_settings.h"

#include <fmt/format.h>

#include <string_view>

#include "command.h"
#include "zinf/core/units.h"

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

// A budget flag: a positive size. 0 is refused rather than read as "unlimited" or "auto".
uint64_t budget_flag(const char* flag, const std::string& text) {
  uint64_t bytes = bytes_flag(flag, text);
  if (bytes == 0) {
    throw CliError(fmt::format("{}: expected a positive size such as 2G, got '{}'; leave the flag "
                               "out for a budget that fits the machine (docs/engine.md)",
                               flag, text),
                   2);
  }
  return bytes;
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
  }
  return "default";
}

TrainSettings build_train_settings(const TrainFlags& f, const config::Config* cfg, int world) {
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
    if (*f.stage < 0 || *f.stage > 3) throw CliError("--stage must be 0..3", 2);
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
    if (*f.grad_accum < 1) throw CliError("--grad-accum must be >= 1", 2);
    c.gradient_accumulation_steps = *f.grad_accum;
  }
  if (f.batch) {
    if (*f.batch < 1) throw CliError("--batch must be >= 1", 2);
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
  if (f.device_mem) c.zinf.device_mem = budget_flag("--device-mem", *f.device_mem);
  if (f.host_mem) c.zinf.host_mem = budget_flag("--host-mem", *f.host_mem);
  if (f.trace) c.zinf.trace = *f.trace;
  if (f.no_checksum) c.zinf.checksum = false;

  // DeepSpeed's rule for an absent overlap_comm, applied to the stage in the end.
  const bool overlap_rule = !sets(entry(t::kOverlapComm.name));
  if (overlap_rule) c.zero.overlap_comm = c.zero.stage == 3;

  // The combinations, in the flags' words first (the config reader says it in the keys').
  if (c.zero.offload_param.enabled() && c.zero.stage != 3) {
    throw CliError(
        fmt::format("parameter offload needs ZeRO stage 3 (--stage 3), got stage {}", c.zero.stage),
        2);
  }
  for (const auto& [flag, block] : {std::pair{"--offload-param", &c.zero.offload_param},
                                    {"--offload-optimizer", &c.zero.offload_optimizer}}) {
    if (block->device == config::OffloadDevice::kNvme && block->nvme_path.empty()) {
      throw CliError(fmt::format("{} nvme needs a swap directory: --nvme-path DIR", flag), 2);
    }
  }
  if (Status s = config::resolve_batch_sizes(c, world); !s.is_ok()) throw CliError(s.detail(), 2);
  Result<EngineSettings> e = settings_from_config(c);
  if (!e.is_ok()) throw CliError(e.status().detail(), 2);
  out.engine = *e;
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
  };
  for (const t::Entry& e : t::kAll) {
    Source s = Source::kDefault;
    if (auto it = flag_given.find(e.flag);
        !e.flag.empty() && it != flag_given.end() && it->second) {
      s = Source::kFlag;
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
  return line;
}

std::string settings_block(const TrainSettings& s, size_t width) {
  nlohmann::ordered_json values = effective_settings_json(s);
  // At most 100 columns, as the lines below.
  std::string out =
      "settings (unmarked: the table's default; zinf train: its own; docs/configuration.md):\n";
  const std::string indent = "  ";
  std::string line;
  for (const t::Entry& e : t::kAll) {
    std::string token = fmt::format("{}={}", e.name, value_text(e, values[std::string(e.name)]));
    if (auto it = s.sources.find(e.name); it != s.sources.end()) {
      token += fmt::format(" ({})", source_name(it->second));
    }
    if (!line.empty() && indent.size() + line.size() + 2 + token.size() > width) {
      out += indent + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : "  ") + token;
  }
  if (!line.empty()) out += indent + line + "\n";
  return out;
}

}  // namespace zinf::cli
