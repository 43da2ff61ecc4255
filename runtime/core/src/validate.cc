#include "zinf/core/validate.h"

#include <fmt/format.h>

namespace zinf::validate {
namespace {

namespace t = tunables;

template <typename... Args>
Status invalid(fmt::format_string<Args...> f, Args&&... args) {
  return make_error(ErrorCode::kInvalidArgument, f, std::forward<Args>(args)...);
}

// The first of the entry's ", "-separated JSON keys.
std::string_view first_json_key(const t::Entry& e) { return e.json.substr(0, e.json.find(',')); }

const t::Entry& home_entry(Offloaded what) {
  return *t::find(what == Offloaded::kParams ? t::kParamHome.name : t::kOptimizerHome.name);
}

// "zero_optimization.offload_param.device" -> "zero_optimization.offload_param.<key>".
std::string block_key(Offloaded what, std::string_view key) {
  const std::string_view device = home_entry(what).json;
  return fmt::format("{}.{}", device.substr(0, device.rfind('.')), key);
}

}  // namespace

std::string label(const t::Entry& e) {
  const std::string_view key = e.json.empty() ? e.name : first_json_key(e);
  if (e.flag.empty()) return std::string(key);
  return fmt::format("{} ({})", key, e.flag);
}

Status stage(int stage) {
  if (stage >= 0 && stage <= 3) return Status::ok();
  return invalid("{}: expected an integer in 0..3, got {}", label(*t::find(t::kStage.name)), stage);
}

Status positive(const t::Entry& e, int64_t value) {
  if (value >= 1) return Status::ok();
  return invalid("{}: expected a positive integer, got {}", label(e), value);
}

Status explicit_budget(const t::Entry& e, uint64_t bytes) {
  if (bytes > 0) return Status::ok();
  return invalid(
      "{}: expected a positive byte count such as 2G, got 0; leave it out for a budget that fits "
      "the machine (docs/engine.md)",
      label(e));
}

Status nvme_path_given(Offloaded what, std::string_view device, size_t paths) {
  if (device != "nvme" || paths > 0) return Status::ok();
  const t::Entry& home = home_entry(what);
  return invalid(
      "{} ({} DIR): expected a directory on the NVMe file system (or a list of them) for device "
      "\"nvme\" ({} nvme), got none",
      block_key(what, "nvme_path"), t::kNvmePaths.flag, home.flag);
}

Status offload_stage(Offloaded what, std::string_view device, int stage, double ratio) {
  if (device == "none") return Status::ok();
  const std::string home = label(home_entry(what));
  if (what == Offloaded::kParams) {
    if (stage == 3) return Status::ok();
    return invalid(
        "{}: parameter offload needs zero_optimization.stage 3 ({} 3), got device \"{}\" with "
        "stage {}",
        home, t::kStage.flag, device, stage);
  }
  if (stage < 1) {
    return invalid(
        "{}: optimizer offload needs zero_optimization.stage 1, 2 or 3, got device \"{}\" with "
        "stage {}",
        home, device, stage);
  }
  if (ratio < 1 && stage != 3) {
    return invalid(
        "{}: partial optimizer offload (ratio < 1) needs zero_optimization.stage 3, got ratio {} "
        "with stage {}",
        label(*t::find(t::kOptimizerOffloadRatio.name)), ratio, stage);
  }
  return Status::ok();
}

Status optimizer_offload_ratio(double ratio) {
  if (ratio > 0 && ratio <= 1) return Status::ok();
  return invalid("{}: expected a fraction in (0, 1], got {}",
                 label(*t::find(t::kOptimizerOffloadRatio.name)), ratio);
}

}  // namespace zinf::validate
