// Writing the effective configuration back out: to_json (DeepSpeed's format, round-trips through
// parse_config) and the start-up log of every tunable.
#include <fmt/format.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "zinf/config/config.h"
#include "zinf/core/log.h"

namespace zinf::config {

using nlohmann::json;

namespace {

// A float as the shortest decimal that reads back to the same float ("0.0001", not
// "9.999999747378752e-05"), so the emitted JSON is what a person would have written.
json float_json(float f) {
  std::string shortest = fmt::format("{}", f);
  double d = std::strtod(shortest.c_str(), nullptr);
  if (static_cast<float>(d) != f) d = static_cast<double>(f);
  return d;
}

json nvme_path_json(const std::vector<std::string>& paths) {
  if (paths.size() == 1) return paths.front();
  return paths;
}

json offload_json(const OffloadConfig& o, bool is_param) {
  json j = {{"device", offload_device_name(o.device)},
            {"buffer_count", o.buffer_count},
            {"pin_memory", o.pin_memory}};
  if (!o.nvme_path.empty()) j["nvme_path"] = nvme_path_json(o.nvme_path);
  if (is_param) {
    j["max_in_cpu"] = o.max_in_cpu;
  } else {
    j["pipeline_read"] = o.pipeline_read;
    j["pipeline_write"] = o.pipeline_write;
    j["ratio"] = o.ratio;
  }
  return j;
}

// The type's own parameters; a required one not resolved yet is written "auto" (as it was read).
json scheduler_json(const SchedulerConfig& s) {
  const json auto_value = "auto";
  json all = {
      {"warmup_min_lr", s.warmup_min_lr},
      {"warmup_num_steps", s.warmup_num_steps},
      {"warmup_type", s.warmup_type == SchedulerConfig::WarmupType::kLog ? "log" : "linear"},
      {"total_num_steps", s.total_num_steps ? json(*s.total_num_steps) : auto_value},
      {"warmup_min_ratio", s.warmup_min_ratio},
      {"cos_min_ratio", s.cos_min_ratio},
      {"cycle_min_lr", s.cycle_min_lr ? json(*s.cycle_min_lr) : auto_value},
      {"cycle_max_lr", s.cycle_max_lr ? json(*s.cycle_max_lr) : auto_value},
      {"decay_lr_rate", s.decay_lr_rate},
      {"cycle_first_step_size", s.cycle_first_step_size},
      {"cycle_first_stair_count", s.cycle_first_stair_count},
      {"decay_step_size", s.decay_step_size},
      {"cycle_momentum", s.cycle_momentum},
      {"cycle_min_mom", s.cycle_min_mom},
      {"cycle_max_mom", s.cycle_max_mom},
      {"decay_mom_rate", s.decay_mom_rate}};
  // Optional without a requirement: written only when set (absent means DeepSpeed's default).
  if (s.warmup_max_lr) all["warmup_max_lr"] = *s.warmup_max_lr;
  if (s.cycle_second_step_size) all["cycle_second_step_size"] = *s.cycle_second_step_size;
  if (s.cycle_second_stair_count) all["cycle_second_stair_count"] = *s.cycle_second_stair_count;
  json params = json::object();
  for (std::string_view key : scheduler_params(s.type)) {
    const std::string k(key);
    if (all.contains(k)) params[k] = all[k];
  }
  return {{"type", scheduler_type_name(s.type)}, {"params", params}};
}

// "a.b=v" for every leaf under `j`, in key order.
void flatten(const json& j, const std::string& prefix, std::vector<std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [key, value] : j.items()) {
      flatten(value, prefix.empty() ? key : prefix + "." + key, out);
    }
    return;
  }
  out.push_back(fmt::format("{}={}", prefix, j.dump()));
}

}  // namespace

json to_json(const Config& c) {
  json j = json::object();
  if (c.train_batch_size != 0) j["train_batch_size"] = c.train_batch_size;
  if (c.train_micro_batch_size_per_gpu != 0) {
    j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  }
  if (c.gradient_accumulation_steps != 0) {
    j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  }
  j["gradient_clipping"] = float_json(c.gradient_clipping);

  const OptimizerConfig& o = c.optimizer;
  j["optimizer"] = {{"type", optimizer_type_name(o.type)},
                    {"params",
                     {{"lr", float_json(o.lr)},
                      {"betas", {float_json(o.beta1), float_json(o.beta2)}},
                      {"eps", float_json(o.eps)},
                      {"weight_decay", float_json(o.weight_decay)},
                      {"adam_w_mode", o.adam_w_mode},
                      {"bias_correction", o.bias_correction}}}};

  const Fp16Config& f = c.fp16;
  j["fp16"] = {{"enabled", f.enabled},
               {"loss_scale", float_json(f.loss_scale)},
               {"initial_scale_power", f.initial_scale_power},
               {"loss_scale_window", f.loss_scale_window},
               {"hysteresis", f.hysteresis},
               {"min_loss_scale", float_json(f.min_loss_scale)}};
  j["bf16"] = {{"enabled", c.bf16}};

  const ZeroConfig& z = c.zero;
  j["zero_optimization"] = {
      {"stage", z.stage},
      {"overlap_comm", z.overlap_comm},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"offload_param", offload_json(z.offload_param, /*is_param=*/true)},
      {"offload_optimizer", offload_json(z.offload_optimizer, /*is_param=*/false)}};

  const AioConfig& a = c.aio;
  j["aio"] = {{"block_size", a.block_size},
              {"queue_depth", a.queue_depth},
              {"intra_op_parallelism", a.intra_op_parallelism},
              {"single_submit", a.single_submit}};

  if (c.scheduler.type != SchedulerConfig::Type::kNone)
    j["scheduler"] = scheduler_json(c.scheduler);

  const ZinfConfig& zc = c.zinf;
  j["zinf"] = {{"trace", zc.trace},
               {"seed", zc.seed},
               {"checksum", zc.checksum},
               {"staging_bytes", zc.staging_bytes},
               {"overlap_optimizer", zc.overlap_optimizer},
               {"update_behind", zc.update_behind},
               {"optimizer_threads", zc.optimizer_threads},
               {"io_fixed_buffers", zc.io_fixed_buffers},
               {"max_nonfinite_steps", zc.max_nonfinite_steps}};
  // 0 is "auto" (fit the machine), which the file says by leaving the key out.
  if (zc.device_mem != 0) j["zinf"]["device_mem"] = zc.device_mem;
  if (zc.host_mem != 0) j["zinf"]["host_mem"] = zc.host_mem;
  return j;
}

void log_effective_config(const Config& c) {
  json j = to_json(c);
  std::vector<std::string> top{fmt::format("working_dtype={}", dtype_name(c.working_dtype()))};
  for (const auto& [key, value] : j.items()) {
    if (value.is_object()) continue;
    top.push_back(fmt::format("{}={}", key, value.dump()));
  }
  if (c.train_micro_batch_size_per_gpu == 0 || c.gradient_accumulation_steps == 0) {
    top.push_back("(batch sizes not shown are derived from the world size)");
  }
  log::info("config: {}", fmt::join(top, " "));
  for (const auto& [key, value] : j.items()) {
    if (!value.is_object()) continue;
    std::vector<std::string> leaves;
    flatten(value, "", leaves);
    log::info("config {}: {}", key, fmt::join(leaves, " "));
  }
  if (!c.auto_keys.empty()) {
    log::info("config: \"auto\" (left to the trainer; until resolved, the default) for: {}",
              fmt::join(c.auto_keys, ", "));
  }
}

}  // namespace zinf::config
