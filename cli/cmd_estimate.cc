// `zinf estimate`: will the model fit, and with which settings? Every ZeRO stage and offload
// choice with the memory it needs per device, per node's host memory and per node's NVMe, what it
// moves per step, whether it fits the memories given, and a config fragment for the one to use.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "train_settings.h"
#include "zinf/core/units.h"
#include "zinf/engine/estimate.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/params.h"

namespace zinf::cli {
namespace {

struct Args {
  std::string params, largest_layer, model, config;
  int gpus_per_node = 0, nodes = 1;
  std::string gpu_mem, cpu_mem, nvme, dtype;
  std::string nvme_path = "/local_nvme";
  std::string config_out;
  std::string conventions = "zinf";
  double buffer_factor = 1.5;
  bool json = false;
};

// The model's units, in forward order: a preset's, or --params cut into units of
// --largest-layer (the last one smaller).
std::vector<uint64_t> model_units(const Args& a, const CLI::App& sub, std::string& described) {
  if (sub.count("--model") > 0) {
    auto preset = gpt::preset(a.model);
    if (!preset.is_ok()) throw CliError(preset.status().message(), 2);
    std::vector<uint64_t> units;
    for (int u = 0; u < preset->num_units(); ++u) {
      units.push_back(static_cast<uint64_t>(gpt::unit_numel(gpt::unit_kind(*preset, u), *preset)));
    }
    described = fmt::format("GPT {} ({})", a.model, gpt::describe(*preset));
    return units;
  }
  const uint64_t total = elements_flag("--params", a.params);
  if (total == 0) throw CliError("--params must be at least 1", 2);
  if (sub.count("--largest-layer") == 0) {
    throw CliError(
        "--params needs --largest-layer: the parameters of the largest unit (a transformer "
        "block), which sizes the working set",
        2);
  }
  const uint64_t largest = elements_flag("--largest-layer", a.largest_layer);
  if (largest == 0 || largest > total) {
    throw CliError(
        fmt::format("--largest-layer must be in [1, --params] (got {} of {})", largest, total), 2);
  }
  if (total / largest > 100000) {
    throw CliError("--params / --largest-layer is over 100000 units: give the largest layer", 2);
  }
  std::vector<uint64_t> units(total / largest, largest);
  if (total % largest) units.push_back(total % largest);
  described =
      fmt::format("{} parameters, largest unit {}", format_count(static_cast<double>(total)),
                  format_count(static_cast<double>(largest)));
  return units;
}

std::string tier_word(Tier t) {
  return t == Tier::kNvme ? "nvme" : t == Tier::kHost ? "cpu" : "device";
}

nlohmann::ordered_json row_json(const EstimateRow& r) {
  return {{"stage", r.placement.stage},
          {"params", tier_word(r.placement.param_home)},
          {"optimizer", tier_word(r.placement.optimizer_home)},
          {"device_bytes", r.device_bytes},
          {"device_min_bytes", r.device_min_bytes},
          {"host_bytes_per_node", r.host_bytes},
          {"host_min_bytes_per_node", r.host_min_bytes},
          {"nvme_bytes_per_node", r.nvme_bytes},
          {"live_window_elements", r.live_window_elements},
          {"collective_bytes_per_step", r.collective_bytes},
          {"pcie_bytes_per_step", r.pcie_bytes},
          {"nvme_read_bytes_per_step", r.nvme_read_bytes},
          {"nvme_write_bytes_per_step", r.nvme_write_bytes},
          {"fits", r.fits},
          {"why_not", r.why_not}};
}

std::string b(uint64_t v) { return v ? format_bytes(static_cast<double>(v)) : "0"; }

void run_deepspeed(const Args& a, const CLI::App& sub, const std::vector<uint64_t>& units) {
  double total = 0, largest = 0;
  for (uint64_t n : units) {
    total += static_cast<double>(n);
    largest = std::max(largest, static_cast<double>(n));
  }
  const bool have_largest = sub.count("--model") > 0 || sub.count("--largest-layer") > 0;
  const auto z2 = deepspeed_zero2_rows(total, a.gpus_per_node, a.nodes, a.buffer_factor);
  const auto z3 = deepspeed_zero3_rows(total, largest, a.gpus_per_node, a.nodes, a.buffer_factor);
  if (a.json) {
    auto rows = [](const std::vector<DeepSpeedRow>& rs) {
      nlohmann::ordered_json out = nlohmann::ordered_json::array();
      for (const auto& r : rs) {
        out.push_back(
            {{"cpu_bytes", r.cpu_bytes}, {"gpu_bytes", r.gpu_bytes}, {"options", r.options}});
      }
      return out;
    };
    nlohmann::ordered_json j = {{"conventions", "deepspeed"},
                                {"total_params", total},
                                {"largest_layer_params", largest},
                                {"additional_buffer_factor", a.buffer_factor},
                                {"zero2", rows(z2)}};
    if (have_largest) j["zero3"] = rows(z3);
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("ZeRO-2 (estimate_zero2_model_states_mem_needs_all_cold):\n%s\n",
              deepspeed_report(z2, total, 0, a.gpus_per_node, a.nodes).c_str());
  std::printf("ZeRO-3 (estimate_zero3_model_states_mem_needs_all_cold):\n%s",
              deepspeed_report(z3, total, largest, a.gpus_per_node, a.nodes).c_str());
}

void run(const Args& a, const CLI::App& sub) {
  const int given =
      static_cast<int>(sub.count("--params") > 0) + static_cast<int>(sub.count("--model") > 0);
  if (given != 1) throw CliError("give the model as one of --params N or --model PRESET", 2);
  if (a.gpus_per_node < 1 || a.nodes < 1) {
    throw CliError("--gpus-per-node and --nodes must be at least 1", 2);
  }
  std::string described;
  const std::vector<uint64_t> units = model_units(a, sub, described);
  if (a.conventions == "deepspeed") return run_deepspeed(a, sub, units);

  // The settings `zinf train` would run with (a DeepSpeed config's dtype, scheduler, staging and
  // cache settings; flags win); the placement is what the estimate varies.
  std::optional<config::Config> cfg;
  if (!a.config.empty()) {
    auto loaded = config::load_config(a.config);
    if (!loaded.is_ok()) throw CliError(loaded.status().detail(), 2);
    cfg = std::move(*loaded);
  }
  TrainFlags flags;
  if (sub.count("--dtype") > 0) flags[std::string(tunables::kDtype.flag)] = {a.dtype};
  const int world = a.gpus_per_node * a.nodes;
  const EngineSettings base = build_train_settings(flags, cfg ? &*cfg : nullptr, world).engine;

  Hardware hw{.gpus_per_node = a.gpus_per_node, .nodes = a.nodes};
  if (!a.gpu_mem.empty()) hw.gpu_mem = bytes_flag("--gpu-mem", a.gpu_mem);
  if (!a.cpu_mem.empty()) hw.cpu_mem = bytes_flag("--cpu-mem", a.cpu_mem);
  if (!a.nvme.empty()) hw.nvme = bytes_flag("--nvme", a.nvme);
  // Automatic budgets as on a node with --cpu-mem of memory, else as on this machine.
  MachineMemory machine{.total_bytes = hw.cpu_mem, .available_bytes = hw.cpu_mem};
  std::string memory_source = "--cpu-mem";
  if (hw.cpu_mem == 0) {
    auto m = read_machine_memory();
    if (!m.is_ok()) throw CliError(m.status().detail(), 1);
    machine = *m;
    memory_source = fmt::format("this machine's MemAvailable, {}, not checked",
                                format_bytes(static_cast<double>(machine.available_bytes)));
  }
  StagingBuffers buffers;
  if (cfg) {
    buffers.param =
        static_cast<uint32_t>(std::max<int64_t>(cfg->zero.offload_param.buffer_count, 2));
    buffers.optimizer =
        static_cast<uint32_t>(std::max<int64_t>(cfg->zero.offload_optimizer.buffer_count, 2));
  }
  auto est = estimate(units, base, hw, machine, buffers);
  if (!est.is_ok()) throw CliError(est.status().detail(), 2);

  const EstimateRow* pick = est->recommended >= 0 ? &est->rows[est->recommended] : nullptr;
  const bool have_config = cfg.has_value();
  const Placement yours{
      .stage = base.stage, .param_home = base.param_home, .optimizer_home = base.optimizer_home};
  nlohmann::ordered_json fragment =
      pick ? config_fragment(pick->placement, base.dtype, a.nvme_path) : nlohmann::ordered_json();
  if (!a.config_out.empty() && pick != nullptr) {
    std::ofstream out(a.config_out, std::ios::trunc);
    out << fragment.dump(2) << "\n";
    if (!out.flush()) throw CliError("cannot write " + a.config_out, 1);
  }
  if (a.json) {
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    for (const auto& r : est->rows) rows.push_back(row_json(r));
    nlohmann::ordered_json j = {
        {"model", described},
        {"parameters", est->parameters},
        {"padded_parameters", est->padded_params},
        {"largest_unit", est->largest_unit},
        {"units", units.size()},
        {"dtype", dtype_name(base.dtype)},
        {"gpus_per_node", a.gpus_per_node},
        {"nodes", a.nodes},
        {"gpu_mem", hw.gpu_mem},
        {"cpu_mem", hw.cpu_mem},
        {"nvme", hw.nvme},
        {"budget_memory_per_node", machine.available_bytes},
        {"rows", rows},
        {"recommended", pick ? nlohmann::ordered_json(row_json(*pick)) : nlohmann::ordered_json()},
        {"reason", est->reason},
        {"config", fragment}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }

  auto memory = [](uint64_t v, const char* what) {
    return v ? fmt::format("{} {}", format_bytes(static_cast<double>(v)), what)
             : std::string("not checked");
  };
  std::printf("zinf estimate: %s; %d unit%s, %d GPU%s per node x %d node%s, %s\n",
              described.c_str(), static_cast<int>(units.size()), units.size() == 1 ? "" : "s",
              a.gpus_per_node, a.gpus_per_node == 1 ? "" : "s", a.nodes, a.nodes == 1 ? "" : "s",
              dtype_name(base.dtype).data());
  std::printf("memories: device %s, host %s, NVMe %s; automatic budgets from %s\n\n",
              memory(hw.gpu_mem, "per GPU").c_str(), memory(hw.cpu_mem, "per node").c_str(),
              memory(hw.nvme, "per node").c_str(), memory_source.c_str());
  std::printf("%-5s %-6s %-9s  %11s %11s %11s  %11s %11s %11s  %s\n", "stage", "params",
              "optimizer", "device/GPU", "host/node", "NVMe/node", "comm/step", "PCIe/step",
              "NVMe/step", "fits");
  for (size_t i = 0; i < est->rows.size(); ++i) {
    const EstimateRow& r = est->rows[i];
    std::string fits = r.fits ? "yes" : "no: " + r.why_not;
    if (static_cast<int>(i) == est->recommended) fits += "  <- recommended";
    if (have_config && yours == r.placement) fits += "  (your config)";
    std::printf("%-5d %-6s %-9s  %11s %11s %11s  %11s %11s %11s  %s\n", r.placement.stage,
                tier_word(r.placement.param_home).c_str(),
                tier_word(r.placement.optimizer_home).c_str(), b(r.device_bytes).c_str(),
                b(r.host_bytes).c_str(), b(r.nvme_bytes).c_str(), b(r.collective_bytes).c_str(),
                b(r.pcie_bytes).c_str(), b(r.nvme_read_bytes + r.nvme_write_bytes).c_str(),
                fits.c_str());
  }
  if (pick == nullptr) {
    std::printf("\nno recommendation: %s\n", est->reason.c_str());
    throw CliError("nothing fits the memories given", 1);
  }
  std::printf("\nrecommended: %s, because %s.\nzinf train --config accepts:\n%s\n",
              placement_name(pick->placement).c_str(), est->reason.c_str(),
              fragment.dump(2).c_str());
}

const Registration kReg{
    "", "estimate",
    "Memory per device, host and NVMe and bytes moved per step for every ZeRO stage and offload "
    "choice; which fit; the one to use, as a config fragment",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--params", a->params,
                     "Parameters of the model (e.g. 2851e6); needs --largest-layer");
      sub.add_option("--largest-layer", a->largest_layer,
                     "Parameters of the largest unit (a transformer block)");
      sub.add_option("--model", a->model,
                     "A GPT preset instead of --params: tiny, small, "
                     "gpt2-124m, 1b, 2b");
      sub.add_option("--config", a->config,
                     "DeepSpeed JSON config: its precision, scheduler, staging and cache settings "
                     "(its own placement is marked in the table)");
      sub.add_option("--gpus-per-node", a->gpus_per_node, "Ranks (GPUs) per node")->required();
      sub.add_option("--nodes", a->nodes, "Nodes")->capture_default_str();
      sub.add_option("--gpu-mem", a->gpu_mem, "Memory per GPU, e.g. 80G (default: not checked)");
      sub.add_option("--cpu-mem", a->cpu_mem,
                     "Host memory per node, e.g. 512G (default: not checked; automatic budgets "
                     "as on this machine)");
      sub.add_option("--nvme", a->nvme, "NVMe space per node, e.g. 4T (default: not checked)");
      sub.add_option("--dtype", a->dtype, "fp32 | bf16 | fp16 (default: the config's, else fp32)");
      sub.add_option("--nvme-path", a->nvme_path, "nvme_path written into the config fragment")
          ->capture_default_str();
      sub.add_option("--conventions", a->conventions,
                     "zinf (zinf's allocations) or deepspeed (the numbers DeepSpeed's "
                     "estimate_zero2/3_model_states_mem_needs_all_cold print)")
          ->check(CLI::IsMember({"zinf", "deepspeed"}))
          ->capture_default_str();
      sub.add_option("--buffer-factor", a->buffer_factor,
                     "DeepSpeed's additional_buffer_factor (--conventions deepspeed)")
          ->capture_default_str();
      sub.add_option(
          "--config-out", a->config_out,
          "Write the recommended config fragment to this file (for zinf train --config)");
      sub.add_flag("--json", a->json, "Print JSON");
      sub.callback([a, &sub] { run(*a, sub); });
    }};

}  // namespace
}  // namespace zinf::cli
