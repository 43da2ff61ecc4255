// Reading DeepSpeed-format JSON into a Config: keys, types, aliases, DeepSpeed's dynamic defaults.
// Value rules live in check.cc; the batch-size relation, which needs the world size, is here.
#include "zinf/config/config.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "check.h"
#include "json_reader.h"
#include "zinf/core/log.h"
#include "zinf/core/validate.h"

namespace zinf::config {

using detail::Auto;
using detail::ObjectReader;
using detail::ParseState;
using nlohmann::json;

std::string_view offload_device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "none";
}

std::string_view optimizer_type_name(OptimizerConfig::Type t) {
  return t == OptimizerConfig::Type::kAdamW ? "AdamW" : "Adam";
}

namespace {

using SchedType = SchedulerConfig::Type;

constexpr std::string_view kWarmupParams[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                              "warmup_type"};
constexpr std::string_view kWarmupDecayParams[] = {
    "total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
constexpr std::string_view kWarmupCosineParams[] = {
    "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"};
constexpr std::string_view kOneCycleParams[] = {"cycle_min_lr",
                                                "cycle_max_lr",
                                                "decay_lr_rate",
                                                "cycle_first_step_size",
                                                "cycle_second_step_size",
                                                "cycle_first_stair_count",
                                                "cycle_second_stair_count",
                                                "decay_step_size",
                                                "cycle_momentum",
                                                "cycle_min_mom",
                                                "cycle_max_mom",
                                                "decay_mom_rate"};

}  // namespace

std::span<const std::string_view> scheduler_params(SchedulerConfig::Type t) {
  switch (t) {
    case SchedType::kNone:
      return {};
    case SchedType::kWarmupLR:
      return kWarmupParams;
    case SchedType::kWarmupDecayLR:
      return kWarmupDecayParams;
    case SchedType::kWarmupCosineLR:
      return kWarmupCosineParams;
    case SchedType::kOneCycle:
      return kOneCycleParams;
  }
  return {};
}

namespace {

using IgnoredType = IgnoredKey::Type;

constexpr std::string_view kHooks =
    "tunes DeepSpeed's PyTorch hooks or checkpoint files, which zinf does not have";
constexpr std::string_view kMonitoring =
    "logging and monitoring: zinf reports through its own log, --log-json and trace file";
constexpr std::string_view kAveraging =
    "zinf averages gradients in one fixed, deterministic way (the communicator's rank-order "
    "average)";

// Every DeepSpeed key zinf accepts and does not act on; checked against what settings_from_config
// (runtime/engine/src/settings.cc) and `zinf train` read. docs/configuration.md lists them too.
constexpr IgnoredKey kIgnored[] = {
    {"steps_per_print", IgnoredType::kNumber, kMonitoring},
    {"wall_clock_breakdown", IgnoredType::kBool, kMonitoring},
    {"dump_state", IgnoredType::kBool, kMonitoring},
    {"memory_breakdown", IgnoredType::kBool, kMonitoring},
    {"tensorboard", IgnoredType::kObject, kMonitoring},
    {"wandb", IgnoredType::kObject, kMonitoring},
    {"csv_monitor", IgnoredType::kObject, kMonitoring},
    {"comms_logger", IgnoredType::kObject, kMonitoring},
    {"flops_profiler", IgnoredType::kObject, kMonitoring},
    {"timers", IgnoredType::kObject, kMonitoring},
    {"zero_allow_untested_optimizer", IgnoredType::kBool, "zinf has its own Adam everywhere"},
    {"zero_force_ds_cpu_optimizer", IgnoredType::kBool, "zinf has its own Adam everywhere"},
    {"gradient_predivide_factor", IgnoredType::kNumber, kAveraging},
    {"prescale_gradients", IgnoredType::kBool, kAveraging},
    {"communication_data_type", IgnoredType::kString, kAveraging},
    {"sparse_gradients", IgnoredType::kBool, "zinf's gradients are dense"},
    {"dataloader_drop_last", IgnoredType::kBool, "zinf has no data loader"},
    {"optimizer.params.torch_adam", IgnoredType::kBool,
     "picks which PyTorch class DeepSpeed uses; the arithmetic is the same"},
    {"fp16.auto_cast", IgnoredType::kBool, "zinf casts nothing on the caller's behalf"},
    {"fp16.consecutive_hysteresis", IgnoredType::kBool,
     "zinf's scaler behaves as consecutive_hysteresis false"},
    {"bf16.immediate_grad_update", IgnoredType::kBool, "zinf accumulates gradients in fp32"},
    {"bf16.check_grad_overflow", IgnoredType::kBool,
     "zinf skips a step on overflow only under fp16 loss scaling"},
    {"zero_optimization.contiguous_gradients", IgnoredType::kBool,
     "zinf's gradients are always one flat buffer per unit"},
    {"zero_optimization.reduce_scatter", IgnoredType::kBool,
     "zinf picks the gradient collective from the stage"},
    {"zero_optimization.allgather_partitions", IgnoredType::kBool, "zinf always all-gathers"},
    {"zero_optimization.allgather_bucket_size", IgnoredType::kNumber,
     "zinf all-gathers one unit at a time"},
    {"zero_optimization.round_robin_gradients", IgnoredType::kBool, kHooks},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", IgnoredType::kBool, kHooks},
    {"zero_optimization.gather_16bit_weights_on_model_save", IgnoredType::kBool, kHooks},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", IgnoredType::kBool, kHooks},
    {"zero_optimization.memory_efficient_linear", IgnoredType::kBool, kHooks},
    {"zero_optimization.load_from_fp32_weights", IgnoredType::kBool, kHooks},
    {"zero_optimization.elastic_checkpoint", IgnoredType::kBool, kHooks},
    {"zero_optimization.ignore_unused_parameters", IgnoredType::kBool, kHooks},
    {"zero_optimization.use_multi_rank_bucket_allreduce", IgnoredType::kBool, kHooks},
    {"zero_optimization.legacy_stage1", IgnoredType::kBool, kHooks},
    {"zero_optimization.stage3_model_persistence_threshold", IgnoredType::kNumber, kHooks},
    {"zero_optimization.model_persistence_threshold", IgnoredType::kNumber, kHooks},
    {"zero_optimization.stage3_module_granularity_threshold", IgnoredType::kNumber, kHooks},
    {"zero_optimization.cpu_offload_use_pin_memory", IgnoredType::kBool,
     "deprecated; use offload_optimizer.pin_memory"},
    {"zero_optimization.override_module_apply", IgnoredType::kBool, kHooks},
    {"zero_optimization.log_trace_cache_warnings", IgnoredType::kBool, kHooks},
    {"zero_optimization.pipeline_loading_checkpoint", IgnoredType::kBool, kHooks},
    {"zero_optimization.enable_sanity_checks", IgnoredType::kBool, kHooks},
    {"zero_optimization.offload_param.buffer_size", IgnoredType::kNumber,
     "zinf's staging piece is zinf.staging_bytes"},
    {"zero_optimization.offload_optimizer.fast_init", IgnoredType::kBool,
     "zinf initialises the optimizer state in one fixed way"},
    {"aio.overlap_events", IgnoredType::kBool,
     "zinf's ring threads always reap completions while submitting"},
    {"aio.use_gds", IgnoredType::kBool,
     "zinf has no GPUDirect Storage path: data is staged through pinned host memory"},
};

}  // namespace

std::span<const IgnoredKey> accepted_but_ignored_keys() { return kIgnored; }

bool config_sets(const Config& c, std::string_view path) {
  return std::binary_search(c.given_keys.begin(), c.given_keys.end(), path);
}

DType Config::working_dtype() const {
  if (fp16.enabled) return DType::kF16;
  if (bf16) return DType::kBF16;
  return DType::kF32;
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return out;
}

// The accepted-but-ignored keys of the object `r` reads, whose canonical path is `path` (the
// reader's own, except for DeepSpeed's older "bfloat16" block): any value of the right JSON type,
// or "auto", is accepted and recorded; nothing else is checked.
Status read_ignored(ObjectReader& r, std::string_view path) {
  for (const IgnoredKey& k : kIgnored) {
    size_t dot = k.path.rfind('.');
    std::string_view parent = dot == std::string_view::npos ? "" : k.path.substr(0, dot);
    if (parent != path) continue;
    std::string_view name = dot == std::string_view::npos ? k.path : k.path.substr(dot + 1);
    const json* v = r.find(name);
    if (v == nullptr) continue;
    bool is_auto = v->is_string() && v->get_ref<const std::string&>() == "auto";
    std::string_view what;
    bool ok = is_auto;
    switch (k.type) {
      case IgnoredType::kBool:
        what = "true or false (the key has no effect in zinf)";
        ok = ok || v->is_boolean();
        break;
      case IgnoredType::kNumber:
        what = "a number (the key has no effect in zinf)";
        ok = ok || v->is_number();
        break;
      case IgnoredType::kString:
        what = "a string (the key has no effect in zinf)";
        ok = ok || v->is_string();
        break;
      case IgnoredType::kObject:
        what = "an object (the key has no effect in zinf)";
        ok = ok || v->is_object();
        break;
    }
    if (!ok) return detail::type_error(r.key_path(name), what, *v);
    r.record_ignored(name);
  }
  return Status::ok();
}

// Reads `key` or DeepSpeed's other name for it, `alias` (giving both is an error).
template <typename T>
Status read_aliased(ObjectReader& r, std::string_view key, std::string_view alias, T& out) {
  bool has_key = r.find(key) != nullptr;
  bool has_alias = r.find(alias) != nullptr;
  if (has_key && has_alias) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} and {}: two names for one setting; expected only one of them",
                      r.key_path(key), r.key_path(alias));
  }
  if (has_alias && r.given(alias)) r.mark_given(key);
  std::string_view name = has_alias ? alias : key;
  if constexpr (std::is_same_v<T, int>) {
    return r.read_int(name, out);
  } else {
    return r.read_uint(name, out);
  }
}

Status read_offload_device(ObjectReader& r, OffloadDevice& out) {
  const json* v = r.find("device");
  if (v == nullptr) return Status::ok();
  constexpr std::string_view kWhat = R"(one of "none", "cpu", "nvme")";
  if (!v->is_string()) return detail::type_error(r.key_path("device"), kWhat, *v);
  std::optional<OffloadDevice> d = parse_offload_device(lower(v->get_ref<const std::string&>()));
  if (!d) return detail::type_error(r.key_path("device"), kWhat, *v);
  out = *d;
  return Status::ok();
}

Status read_nvme_path(ObjectReader& r, std::vector<std::string>& out) {
  const json* v = r.find("nvme_path");
  if (v == nullptr) return Status::ok();
  constexpr std::string_view kWhat = "a directory path or a list of directory paths";
  if (v->is_string()) {
    out = {v->get<std::string>()};
    return Status::ok();
  }
  if (!v->is_array()) return detail::type_error(r.key_path("nvme_path"), kWhat, *v);
  out.clear();
  for (size_t i = 0; i < v->size(); ++i) {
    const json& entry = (*v)[i];
    if (!entry.is_string()) {
      return detail::type_error(fmt::format("{}[{}]", r.key_path("nvme_path"), i),
                                "a directory path (a string)", entry);
    }
    out.push_back(entry.get<std::string>());
  }
  return Status::ok();
}

// offload_param and offload_optimizer: each accepts the keys DeepSpeed defines for it.
Status read_offload(ObjectReader& r, bool is_param, OffloadConfig& o) {
  ZINF_RETURN_IF_ERROR(read_offload_device(r, o.device));
  ZINF_RETURN_IF_ERROR(read_nvme_path(r, o.nvme_path));
  ZINF_RETURN_IF_ERROR(r.read_int("buffer_count", o.buffer_count));
  ZINF_RETURN_IF_ERROR(r.read_bool("pin_memory", o.pin_memory));
  if (is_param) {
    ZINF_RETURN_IF_ERROR(r.read_uint("max_in_cpu", o.max_in_cpu));
  } else {
    ZINF_RETURN_IF_ERROR(r.read_bool("pipeline_read", o.pipeline_read));
    ZINF_RETURN_IF_ERROR(r.read_bool("pipeline_write", o.pipeline_write));
    ZINF_RETURN_IF_ERROR(r.read_double("ratio", o.ratio));
    r.ignore({"pipeline"});  // DeepSpeed derives it: pipeline_read || pipeline_write
  }
  ZINF_RETURN_IF_ERROR(read_ignored(r, r.path()));
  r.finish();
  return Status::ok();
}

// Deprecated DeepSpeed switches "cpu_offload" / "cpu_offload_param": true means device "cpu".
Status read_deprecated_offload(ObjectReader& z, std::string_view old_key, std::string_view new_key,
                               OffloadConfig& o) {
  bool on = false;
  ZINF_RETURN_IF_ERROR(z.read_bool(old_key, on));
  if (!z.given(old_key)) return Status::ok();
  if (z.given(new_key)) {
    return make_error(ErrorCode::kInvalidArgument, "{} (deprecated) and {}: expected only {}",
                      z.key_path(old_key), z.key_path(new_key), z.key_path(new_key));
  }
  log::warn("config: {} is deprecated in DeepSpeed; use {} {{\"device\": \"cpu\"}}",
            z.key_path(old_key), z.key_path(new_key));
  if (on) {
    o.device = OffloadDevice::kCpu;
    z.mark_given(fmt::format("{}.device", new_key));
  }
  return Status::ok();
}

Status read_zero(ObjectReader& z, ZeroConfig& c) {
  {
    constexpr std::string_view kWhat = "an integer in 0..3";
    ZINF_ASSIGN_OR_RETURN(const json* stage, z.value("stage", Auto::kRefused, kWhat));
    if (stage != nullptr) {
      // Any integer here; the range is validate::stage's, checked with the other rules.
      std::optional<int64_t> s = detail::as_int(*stage, INT_MIN, INT_MAX);
      if (!s) return detail::type_error(z.key_path("stage"), kWhat, *stage);
      c.stage = static_cast<int>(*s);
      ZINF_RETURN_IF_ERROR(validate::stage(c.stage));
    }
  }
  c.overlap_comm = tunables::overlap_comm_for_stage(c.stage);  // when the key is absent
  ZINF_RETURN_IF_ERROR(z.read_bool("overlap_comm", c.overlap_comm));
  ZINF_RETURN_IF_ERROR(z.read_uint("reduce_bucket_size", c.reduce_bucket_size));
  ZINF_RETURN_IF_ERROR(z.read_uint("sub_group_size", c.sub_group_size));
  ZINF_RETURN_IF_ERROR(read_aliased(z, "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                    c.stage3_prefetch_bucket_size));
  ZINF_RETURN_IF_ERROR(read_aliased(z, "stage3_param_persistence_threshold",
                                    "param_persistence_threshold",
                                    c.stage3_param_persistence_threshold));
  ZINF_RETURN_IF_ERROR(read_aliased(z, "stage3_max_live_parameters", "max_live_parameters",
                                    c.stage3_max_live_parameters));
  ZINF_RETURN_IF_ERROR(read_aliased(z, "stage3_max_reuse_distance", "max_reuse_distance",
                                    c.stage3_max_reuse_distance));

  ZINF_ASSIGN_OR_RETURN(auto param, z.object("offload_param"));
  if (param) ZINF_RETURN_IF_ERROR(read_offload(*param, /*is_param=*/true, c.offload_param));
  ZINF_ASSIGN_OR_RETURN(auto optim, z.object("offload_optimizer"));
  if (optim) ZINF_RETURN_IF_ERROR(read_offload(*optim, /*is_param=*/false, c.offload_optimizer));
  ZINF_RETURN_IF_ERROR(
      read_deprecated_offload(z, "cpu_offload", "offload_optimizer", c.offload_optimizer));
  ZINF_RETURN_IF_ERROR(
      read_deprecated_offload(z, "cpu_offload_param", "offload_param", c.offload_param));

  ZINF_RETURN_IF_ERROR(read_ignored(z, z.path()));
  z.finish();
  return Status::ok();
}

Status read_optimizer(ObjectReader& r, OptimizerConfig& o) {
  const json* type = r.find("type");
  constexpr std::string_view kSupported = "one of the supported optimizers: Adam, AdamW";
  if (type == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "{}: missing; expected {}", r.key_path("type"),
                      kSupported);
  }
  if (!type->is_string()) return detail::type_error(r.key_path("type"), kSupported, *type);
  std::string name = lower(type->get_ref<const std::string&>());
  if (name == "adam") {
    o.type = OptimizerConfig::Type::kAdam;
  } else if (name == "adamw") {
    o.type = OptimizerConfig::Type::kAdamW;
  } else {
    return make_error(ErrorCode::kInvalidArgument, "{}: unsupported optimizer \"{}\"; expected {}",
                      r.key_path("type"), type->get_ref<const std::string&>(), kSupported);
  }

  ZINF_ASSIGN_OR_RETURN(auto params, r.object("params"));
  if (params) {
    ObjectReader& p = *params;
    ZINF_RETURN_IF_ERROR(p.read_float("lr", o.lr));
    ZINF_RETURN_IF_ERROR(p.read_float("eps", o.eps));
    ZINF_RETURN_IF_ERROR(p.read_float("weight_decay", o.weight_decay));
    ZINF_RETURN_IF_ERROR(p.read_bool("bias_correction", o.bias_correction));
    ZINF_RETURN_IF_ERROR(p.read_bool("adam_w_mode", o.adam_w_mode));
    if (o.type == OptimizerConfig::Type::kAdamW && !o.adam_w_mode) {
      // DeepSpeed: AdamW is decoupled whatever adam_w_mode says. Follow it, and say so.
      log::warn(
          "config: {} is false but type is AdamW, which always decays weights decoupled "
          "(as DeepSpeed); use type Adam for L2 weight decay",
          p.key_path("adam_w_mode"));
      o.adam_w_mode = true;
    }
    bool amsgrad = false;
    ZINF_RETURN_IF_ERROR(p.read_bool("amsgrad", amsgrad));
    if (amsgrad) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: zinf does not implement AMSGrad; expected false, got true",
                        p.key_path("amsgrad"));
    }
    constexpr std::string_view kBetas = "an array of two numbers in [0, 1)";
    ZINF_ASSIGN_OR_RETURN(const json* betas, p.value("betas", Auto::kAllowed, kBetas));
    if (betas != nullptr) {
      if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() ||
          !(*betas)[1].is_number()) {
        return detail::type_error(p.key_path("betas"), kBetas, *betas);
      }
      double beta1 = (*betas)[0].get<double>();
      double beta2 = (*betas)[1].get<double>();
      if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1)) {
        return detail::type_error(p.key_path("betas"), kBetas, *betas);
      }
      o.beta1 = static_cast<float>(beta1);
      o.beta2 = static_cast<float>(beta2);
    }
    ZINF_RETURN_IF_ERROR(read_ignored(p, p.path()));
    p.finish();
  }
  r.finish();
  return Status::ok();
}

// An optional parameter: set only when the document gives a value ("auto" leaves it unset).
template <typename T>
Status read_optional(ObjectReader& r, std::string_view key, std::optional<T>& out) {
  T value{};
  if constexpr (std::is_same_v<T, double>) {
    ZINF_RETURN_IF_ERROR(r.read_double(key, value));
  } else {
    ZINF_RETURN_IF_ERROR(r.read_int(key, value));
  }
  if (r.given(key)) out = value;
  return Status::ok();
}

// The "scheduler" block: "type" (required, DeepSpeed's exact name) and "params", of which each
// type accepts its own (scheduler_params()). Ranges are checked in check.cc.
Status read_scheduler(ObjectReader& r, SchedulerConfig& s) {
  std::string supported;
  for (SchedType t : {SchedType::kWarmupLR, SchedType::kWarmupDecayLR, SchedType::kWarmupCosineLR,
                      SchedType::kOneCycle}) {
    supported += fmt::format("{}{}", supported.empty() ? "" : ", ", scheduler_type_name(t));
  }
  const std::string what = "one of the supported schedules: " + supported;
  ZINF_ASSIGN_OR_RETURN(const json* type, r.value("type", Auto::kRefused, what));
  if (type == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "{}: missing; expected {}", r.key_path("type"),
                      what);
  }
  if (!type->is_string()) return detail::type_error(r.key_path("type"), what, *type);
  std::optional<SchedType> t = parse_scheduler_type(type->get_ref<const std::string&>());
  if (!t || *t == SchedType::kNone) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: unsupported schedule \"{}\"; expected {} (names as DeepSpeed spells "
                      "them; LRRangeTest and torch.optim schedules are not supported)",
                      r.key_path("type"), type->get_ref<const std::string&>(), what);
  }
  s.type = *t;

  ZINF_ASSIGN_OR_RETURN(auto params, r.object("params"));
  if (params) {
    ObjectReader& p = *params;
    const std::span<const std::string_view> accepted = scheduler_params(s.type);
    for (const auto& [key, value] : p.json_object().items()) {
      if (std::find(accepted.begin(), accepted.end(), key) != accepted.end()) continue;
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: not a parameter of {}; expected one of: {}", p.key_path(key),
                        scheduler_type_name(s.type), fmt::join(accepted, ", "));
    }
    ZINF_RETURN_IF_ERROR(p.read_double("warmup_min_lr", s.warmup_min_lr));
    ZINF_RETURN_IF_ERROR(read_optional(p, "warmup_max_lr", s.warmup_max_lr));
    ZINF_RETURN_IF_ERROR(p.read_int("warmup_num_steps", s.warmup_num_steps));
    if (const json* wt = p.find("warmup_type"); wt != nullptr && p.given("warmup_type")) {
      constexpr std::string_view kWhat = R"("log" or "linear")";
      if (!wt->is_string()) return detail::type_error(p.key_path("warmup_type"), kWhat, *wt);
      const std::string& name = wt->get_ref<const std::string&>();
      if (name == "log") {
        s.warmup_type = SchedulerConfig::WarmupType::kLog;
      } else if (name == "linear") {
        s.warmup_type = SchedulerConfig::WarmupType::kLinear;
      } else {
        // DeepSpeed warns and falls back to "log"; zinf refuses rather than guess.
        return detail::type_error(p.key_path("warmup_type"), kWhat, *wt);
      }
    }
    ZINF_RETURN_IF_ERROR(read_optional(p, "total_num_steps", s.total_num_steps));
    ZINF_RETURN_IF_ERROR(p.read_double("warmup_min_ratio", s.warmup_min_ratio));
    ZINF_RETURN_IF_ERROR(p.read_double("cos_min_ratio", s.cos_min_ratio));
    ZINF_RETURN_IF_ERROR(read_optional(p, "cycle_min_lr", s.cycle_min_lr));
    ZINF_RETURN_IF_ERROR(read_optional(p, "cycle_max_lr", s.cycle_max_lr));
    ZINF_RETURN_IF_ERROR(p.read_double("decay_lr_rate", s.decay_lr_rate));
    ZINF_RETURN_IF_ERROR(p.read_double("cycle_first_step_size", s.cycle_first_step_size));
    ZINF_RETURN_IF_ERROR(read_optional(p, "cycle_second_step_size", s.cycle_second_step_size));
    ZINF_RETURN_IF_ERROR(p.read_int("cycle_first_stair_count", s.cycle_first_stair_count));
    ZINF_RETURN_IF_ERROR(read_optional(p, "cycle_second_stair_count", s.cycle_second_stair_count));
    ZINF_RETURN_IF_ERROR(p.read_double("decay_step_size", s.decay_step_size));
    ZINF_RETURN_IF_ERROR(p.read_bool("cycle_momentum", s.cycle_momentum));
    ZINF_RETURN_IF_ERROR(p.read_double("cycle_min_mom", s.cycle_min_mom));
    ZINF_RETURN_IF_ERROR(p.read_double("cycle_max_mom", s.cycle_max_mom));
    ZINF_RETURN_IF_ERROR(p.read_double("decay_mom_rate", s.decay_mom_rate));
    p.finish();
  }
  // Required parameters left out (not "auto", which the trainer resolves).
  auto require = [&](std::string_view key, bool has) -> Status {
    const std::string path = fmt::format("{}.params.{}", r.path(), key);
    if (has || std::find(r.state().auto_keys.begin(), r.state().auto_keys.end(), path) !=
                   r.state().auto_keys.end()) {
      return Status::ok();
    }
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: missing; {} requires it (DeepSpeed has no "
                      "default)",
                      path, scheduler_type_name(s.type));
  };
  if (s.type == SchedType::kWarmupDecayLR || s.type == SchedType::kWarmupCosineLR) {
    ZINF_RETURN_IF_ERROR(require("total_num_steps", s.total_num_steps.has_value()));
  }
  if (s.type == SchedType::kOneCycle) {
    ZINF_RETURN_IF_ERROR(require("cycle_min_lr", s.cycle_min_lr.has_value()));
    ZINF_RETURN_IF_ERROR(require("cycle_max_lr", s.cycle_max_lr.has_value()));
  }
  r.finish();
  return Status::ok();
}

Status read_fp16(ObjectReader& r, Fp16Config& f) {
  ZINF_RETURN_IF_ERROR(r.read_bool("enabled", f.enabled));
  ZINF_RETURN_IF_ERROR(r.read_float("loss_scale", f.loss_scale));
  ZINF_RETURN_IF_ERROR(r.read_int("initial_scale_power", f.initial_scale_power));
  ZINF_RETURN_IF_ERROR(r.read_int("loss_scale_window", f.loss_scale_window));
  ZINF_RETURN_IF_ERROR(r.read_int("hysteresis", f.hysteresis));
  ZINF_RETURN_IF_ERROR(r.read_float("min_loss_scale", f.min_loss_scale));
  ZINF_RETURN_IF_ERROR(read_ignored(r, r.path()));
  r.finish();
  return Status::ok();
}

Status read_aio(ObjectReader& r, AioConfig& a) {
  ZINF_RETURN_IF_ERROR(r.read_uint("block_size", a.block_size));
  ZINF_RETURN_IF_ERROR(r.read_int("queue_depth", a.queue_depth));
  ZINF_RETURN_IF_ERROR(
      read_aliased(r, "intra_op_parallelism", "thread_count", a.intra_op_parallelism));
  ZINF_RETURN_IF_ERROR(r.read_bool("single_submit", a.single_submit));
  ZINF_RETURN_IF_ERROR(read_ignored(r, r.path()));
  r.finish();
  return Status::ok();
}

Status read_zinf(ObjectReader& r, ZinfConfig& z) {
  // Budgets: 0 in the struct means auto; written in the file it is refused, so that nobody asks
  // for "unlimited" and gets a budget that fits the machine instead (or the other way round).
  for (auto [key, field, entry] :
       {std::tuple{"device_mem", &z.device_mem, tunables::find(tunables::kDeviceMem.name)},
        {"host_mem", &z.host_mem, tunables::find(tunables::kHostMem.name)}}) {
    ZINF_RETURN_IF_ERROR(r.read_bytes(key, *field));
    if (r.given(key)) ZINF_RETURN_IF_ERROR(validate::explicit_budget(*entry, *field));
  }
  ZINF_RETURN_IF_ERROR(r.read_string("trace", z.trace));
  ZINF_RETURN_IF_ERROR(r.read_uint("seed", z.seed));
  ZINF_RETURN_IF_ERROR(r.read_bool("checksum", z.checksum));
  ZINF_RETURN_IF_ERROR(r.read_bytes("staging_bytes", z.staging_bytes));
  ZINF_RETURN_IF_ERROR(r.read_bool("overlap_optimizer", z.overlap_optimizer));
  ZINF_RETURN_IF_ERROR(r.read_bool("update_behind", z.update_behind));
  ZINF_RETURN_IF_ERROR(r.read_int("optimizer_threads", z.optimizer_threads));
  ZINF_RETURN_IF_ERROR(r.read_bool("io_fixed_buffers", z.io_fixed_buffers));
  ZINF_RETURN_IF_ERROR(r.read_uint("max_nonfinite_steps", z.max_nonfinite_steps));
  r.finish();
  return Status::ok();
}

// train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: given values
// must be positive; when train_batch_size is given, the ones left out become 0 ("derive").
Status read_batch(ObjectReader& top, Config& c) {
  struct Key {
    std::string_view name;
    int64_t* field;
    const tunables::Entry* entry;  // nullptr: train_batch_size, which has no entry
    bool given;
  };
  Key keys[] = {{"train_batch_size", &c.train_batch_size, nullptr, false},
                {"train_micro_batch_size_per_gpu", &c.train_micro_batch_size_per_gpu,
                 tunables::find(tunables::kMicroBatch.name), false},
                {"gradient_accumulation_steps", &c.gradient_accumulation_steps,
                 tunables::find(tunables::kGradientAccumulationSteps.name), false}};
  for (Key& k : keys) {
    k.given = top.given(k.name);
    ZINF_RETURN_IF_ERROR(top.read_int(k.name, *k.field));
    if (!k.given) continue;
    if (k.entry != nullptr) ZINF_RETURN_IF_ERROR(validate::positive(*k.entry, *k.field));
    if (*k.field < 1) {
      return make_error(ErrorCode::kInvalidArgument, "{}: expected a positive integer, got {}",
                        k.name, *k.field);
    }
  }
  bool batch_given = keys[0].given, micro_given = keys[1].given, accum_given = keys[2].given;
  if (batch_given) {
    // As DeepSpeed: with only train_batch_size, accumulation is 1 and the micro batch derived.
    if (!micro_given) c.train_micro_batch_size_per_gpu = 0;
    if (!accum_given) c.gradient_accumulation_steps = micro_given ? 0 : 1;
  }
  return Status::ok();
}

// Runs `read` on the nested object `key` of `r` when it is present.
template <typename Fn>
Status read_block(ObjectReader& r, std::string_view key, Fn&& read) {
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> block, r.object(key));
  if (!block) return Status::ok();
  return read(*block);
}

Status read_top(ObjectReader& top, Config& c) {
  ZINF_RETURN_IF_ERROR(read_batch(top, c));
  ZINF_RETURN_IF_ERROR(top.read_float("gradient_clipping", c.gradient_clipping));
  ZINF_RETURN_IF_ERROR(read_block(top, "optimizer",
                                  [&](ObjectReader& r) { return read_optimizer(r, c.optimizer); }));
  ZINF_RETURN_IF_ERROR(read_block(top, "scheduler",
                                  [&](ObjectReader& r) { return read_scheduler(r, c.scheduler); }));
  ZINF_RETURN_IF_ERROR(
      read_block(top, "fp16", [&](ObjectReader& r) { return read_fp16(r, c.fp16); }));

  // "bfloat16" is DeepSpeed's older name of the "bf16" block.
  if (top.find("bf16") != nullptr && top.find("bfloat16") != nullptr) {
    return make_error(ErrorCode::kInvalidArgument,
                      "bf16 and bfloat16: two names for one block; expected only one of them");
  }
  for (std::string_view name : {"bf16", "bfloat16"}) {
    ZINF_RETURN_IF_ERROR(read_block(top, name, [&](ObjectReader& r) {
      ZINF_RETURN_IF_ERROR(r.read_bool("enabled", c.bf16));
      if (name == "bfloat16" && r.given("enabled")) top.mark_given("bf16.enabled");
      ZINF_RETURN_IF_ERROR(read_ignored(r, "bf16"));
      r.finish();
      return Status::ok();
    }));
  }

  ZINF_RETURN_IF_ERROR(
      read_block(top, "zero_optimization", [&](ObjectReader& r) { return read_zero(r, c.zero); }));
  ZINF_RETURN_IF_ERROR(read_block(top, "aio", [&](ObjectReader& r) { return read_aio(r, c.aio); }));
  ZINF_RETURN_IF_ERROR(
      read_block(top, "zinf", [&](ObjectReader& r) { return read_zinf(r, c.zinf); }));

  ZINF_RETURN_IF_ERROR(read_ignored(top, ""));
  top.finish();
  return Status::ok();
}

// Duplicate keys are an error, as in DeepSpeed (its loader refuses them); nlohmann::json would
// silently keep the last. The parser callback sees every key; the first duplicate is remembered.
class DuplicateKeyFinder {
 public:
  // DeepSpeed's configs nest a few levels; a deeper document is refused while it is parsed (each
  // level would cost this finder a frame and a path).
  static constexpr int kMaxDepth = 64;
  struct TooDeep {};

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth) throw TooDeep{};
    switch (event) {
      case json::parse_event_t::object_start:
        frames_.push_back({path_of_child(), {}, {}});
        break;
      case json::parse_event_t::array_start:
        frames_.push_back({path_of_child(), {}, {}, /*is_array=*/true});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        if (!frames_.empty()) frames_.back().value_done();
        break;
      case json::parse_event_t::key: {
        Frame& f = frames_.back();
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!f.keys.insert(key).second && duplicate_.empty()) {
          duplicate_ = detail::join_path(f.path, key);
        }
        f.last_key = key;
        break;
      }
      case json::parse_event_t::value:
        if (!frames_.empty()) frames_.back().value_done();
        break;
    }
    return true;
  }

  const std::string& duplicate() const { return duplicate_; }

 private:
  struct Frame {
    std::string path;
    std::set<std::string> keys;
    std::string last_key;
    bool is_array = false;
    size_t index = 0;
    void value_done() {
      if (is_array) ++index;
    }
  };

  std::string path_of_child() const {
    if (frames_.empty()) return "";
    const Frame& f = frames_.back();
    if (f.is_array) return fmt::format("{}[{}]", f.path, f.index);
    return detail::join_path(f.path, f.last_key);
  }

  std::vector<Frame> frames_;
  std::string duplicate_;
};

// 1-based line and column of byte offset `offset` in `text`.
std::pair<size_t, size_t> line_and_column(std::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

// Resolves the batch sizes left at 0 and checks the relation; writes nothing on error.
Status derive_batch(int64_t& batch, int64_t& micro, int64_t& accum, int world_size) {
  if (world_size < 1) {
    return make_error(ErrorCode::kInvalidArgument, "world size: expected >= 1, got {}", world_size);
  }
  int64_t b = batch, m = micro, a = accum, w = world_size;
  if (m == 0) {
    if (a == 0) a = 1;
    m = b / (a * w);
    if (m == 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "train_batch_size: {} is smaller than gradient_accumulation_steps {} * "
                        "world size {}; expected at least one sample per rank and micro-step",
                        b, a, w);
    }
  } else if (a == 0) {
    a = b / (m * w);
    if (a == 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "train_batch_size: {} is smaller than train_micro_batch_size_per_gpu {} * "
                        "world size {}; expected a multiple of it",
                        b, m, w);
    }
  }
  int64_t product = 0;
  if (__builtin_mul_overflow(m, a, &product) || __builtin_mul_overflow(product, w, &product)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "train_micro_batch_size_per_gpu {} * gradient_accumulation_steps {} * world "
                      "size {}: the product does not fit in 64 bits",
                      m, a, w);
  }
  if (b == 0) b = product;
  if (b != product) {
    return make_error(ErrorCode::kInvalidArgument,
                      "train_batch_size: expected train_micro_batch_size_per_gpu {} * "
                      "gradient_accumulation_steps {} * world size {} = {}, got {}",
                      m, a, w, product, b);
  }
  batch = b;
  micro = m;
  accum = a;
  return Status::ok();
}

}  // namespace

Result<Config> parse_config(const json& j) {
  if (!j.is_object()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config: expected a JSON object at the top level, got {}",
                      detail::describe(j));
  }
  ParseState state;
  Config c;
  ObjectReader top(j, "", state);
  ZINF_RETURN_IF_ERROR(read_top(top, c));
  std::sort(state.unknown_keys.begin(), state.unknown_keys.end());
  std::sort(state.ignored_keys.begin(), state.ignored_keys.end());
  if (!state.unknown_keys.empty()) {
    log::warn("config: ignoring {} key(s) zinf does not know: {}", state.unknown_keys.size(),
              fmt::join(state.unknown_keys, ", "));
  }
  if (!state.ignored_keys.empty()) {
    log::warn(
        "config: {} DeepSpeed key(s) accepted but not acted on by zinf (docs/configuration.md "
        "says why): {}",
        state.ignored_keys.size(), fmt::join(state.ignored_keys, ", "));
  }
  ZINF_RETURN_IF_ERROR(detail::check_config(c));
  c.unknown_keys = std::move(state.unknown_keys);
  c.auto_keys = std::move(state.auto_keys);
  c.ignored_keys = std::move(state.ignored_keys);
  c.given_keys.assign(state.given_keys.begin(), state.given_keys.end());
  return c;
}

Result<Config> parse_config_text(std::string_view text) {
  DuplicateKeyFinder duplicates;
  json j;
  try {
    j = json::parse(text.begin(), text.end(), std::ref(duplicates));
  } catch (const json::parse_error& e) {
    // nlohmann's `byte` is 1-based and points just past the offending character.
    auto [line, column] = line_and_column(text, e.byte == 0 ? 0 : e.byte - 1);
    std::string_view what = e.what();
    if (size_t colon = what.find(": ", what.find("column")); colon != std::string_view::npos) {
      what.remove_prefix(colon + 2);
    }
    return make_error(ErrorCode::kInvalidArgument,
                      "config is not valid JSON: line {}, column {}: {}", line, column, what);
  } catch (const DuplicateKeyFinder::TooDeep&) {
    return make_error(ErrorCode::kInvalidArgument,
                      "config nests objects and arrays deeper than {} levels",
                      DuplicateKeyFinder::kMaxDepth);
  } catch (const json::exception& e) {  // a number out of range (1e400), and the like
    std::string_view what = e.what();
    if (size_t bracket = what.find("] "); bracket != std::string_view::npos) {
      what.remove_prefix(bracket + 2);
    }
    return make_error(ErrorCode::kInvalidArgument, "config is not valid: {}", what);
  }
  if (!duplicates.duplicate().empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: the key appears twice in its object; expected it once",
                      duplicates.duplicate());
  }
  return parse_config(j);
}

constexpr size_t kMaxConfigBytes = size_t{16} << 20;

Result<Config> load_config(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return errno_status(errno, fmt::format("cannot open config file {}", path));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return make_error(ErrorCode::kInvalidArgument, "config file {} is not a regular file", path);
  }
  std::string text;
  char chunk[65536];
  for (;;) {
    if (text.size() > kMaxConfigBytes) {  // a config is a few KiB; this is not one
      ::close(fd);
      return make_error(ErrorCode::kInvalidArgument, "config file {} is larger than {} bytes", path,
                        kMaxConfigBytes);
    }
    ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      return errno_status(err, fmt::format("cannot read config file {}", path));
    }
    if (n == 0) break;
    text.append(chunk, static_cast<size_t>(n));
  }
  ::close(fd);
  Result<Config> c = parse_config_text(text);
  if (!c) return std::move(c).take_status().with_context(fmt::format("config file {}", path));
  return c;
}

Status validate(const Config& c, int world_size) {
  ZINF_RETURN_IF_ERROR(detail::check_config(c));
  int64_t batch = c.train_batch_size, micro = c.train_micro_batch_size_per_gpu,
          accum = c.gradient_accumulation_steps;
  return derive_batch(batch, micro, accum, world_size);
}

Status resolve_batch_sizes(Config& c, int world_size) {
  ZINF_RETURN_IF_ERROR(detail::check_config(c));
  return derive_batch(c.train_batch_size, c.train_micro_batch_size_per_gpu,
                      c.gradient_accumulation_steps, world_size);
}

}  // namespace zinf::config
