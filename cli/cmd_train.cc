// `zinf train`: the GPT example trained through the Engine.
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shutdown.h"
#include "train_settings.h"
#include "zinf/comm/factory.h"
#include "zinf/core/log.h"
#include "zinf/core/state_bytes.h"
#include "zinf/core/trace.h"
#include "zinf/core/tunables.h"
#include "zinf/core/units.h"
#include "zinf/gpt/trainer.h"

namespace zinf::cli {
namespace {

namespace t = tunables;

// "trace.json" -> "trace.rank2.json"; a name without an extension gets ".rank2" at its end.
std::string with_rank_suffix(const std::string& path, int rank) {
  if (path.empty()) return path;
  const size_t slash = path.rfind('/');
  const size_t dot = path.rfind('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  const std::string tag = fmt::format(".rank{}", rank);
  return has_ext ? path.substr(0, dot) + tag + path.substr(dot) : path + tag;
}

// The command line as parsed. The flags that set a tunable are the table's
// (zinf/core/tunables.h), registered and read by TrainFlagOptions; what a flag left out means
// comes from the table through build_train_settings().
struct Args {
  std::string model = "small";
  int layers = 0, dim = 0, heads = 0, seq = 0;
  int steps = 200;
  std::string data;
  int ranks = 1;
  std::string config;
  std::string log_json, export_path;
  std::string save_dir, resume, init_from;
  int save_every = 0, keep = 0;
  int sample = 0;
  bool quiet = false;
  bool describe = false;
  bool show_settings = false;
  TrainFlagOptions tunables;
};

// Peak resident set size of this process, in bytes.
uint64_t peak_rss_bytes() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

void print_memory_table(const gpt::TrainReport& r, DType dtype) {
  const double P = static_cast<double>(r.padded_parameters);
  // Plain data parallelism holds everything on every rank: params and grads in the working
  // dtype, fp32 master (mixed precision), m and v.
  const double wsize = static_cast<double>(dtype_size(dtype));
  const double plain = P * (2 * wsize + static_cast<double>(optimizer_state_bytes_per_element(
                                            dtype, Accumulator::kExcluded)));
  std::printf("\nMemory per rank (peak), against plain data parallelism (%s on the device):\n",
              format_bytes(plain).c_str());
  std::printf("  %-5s %-12s %-12s %-12s %s\n", "rank", "device", "host", "nvme",
              "device vs plain DP");
  for (size_t rank = 0; rank < r.memory.size(); ++rank) {
    const auto& m = r.memory[rank];
    double dev = static_cast<double>(m.tiers[0].peak);
    std::printf("  %-5zu %-12s %-12s %-12s %.1f%%\n", rank, format_bytes(dev).c_str(),
                format_bytes(static_cast<double>(m.tiers[1].peak)).c_str(),
                format_bytes(static_cast<double>(m.tiers[2].peak)).c_str(),
                plain > 0 ? 100.0 * dev / plain : 0.0);
  }
}

void run(const Args& a, const CLI::App& sub) {
  gpt::TrainOptions o;
  auto preset = gpt::preset(a.model);
  if (!preset.is_ok()) throw CliError(preset.status().message(), 2);
  o.model = *preset;
  o.model_name = a.model;
  if (a.layers) o.model.layers = a.layers;
  if (a.dim) o.model.dim = a.dim;
  if (a.heads) o.model.heads = a.heads;
  if (a.seq) o.model.seq = a.seq;
  if (a.describe) {
    if (Status s = gpt::validate(o.model); !s.is_ok()) throw CliError(s.detail(), 2);
    uint64_t p = static_cast<uint64_t>(gpt::parameter_count(o.model));
    nlohmann::json j = {{"model", a.model},
                        {"shape", gpt::describe(o.model)},
                        {"parameters", p},
                        {"training_state_bytes_fp32", 16 * p}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  o.steps = a.steps;
  o.data = a.data;
  // One rank per process when a launcher started this one (mpirun, srun, torchrun-style
  // variables: docs/multi-node.md), else --ranks local threads. Either way one run, one voice:
  // rank 0 prints and writes the log; the other processes print only their errors.
  auto launch = comm::comm_config_from_env();
  if (!launch.is_ok()) throw CliError(launch.status().detail(), 2);
  o.comm_timeout = launch->timeout;
  o.ranks = a.ranks;
  if (launch->source != comm::EnvSource::kNone) {
    if (sub.count("--ranks") > 0 && a.ranks != 1) {
      throw CliError(fmt::format("--ranks {}: under a launcher ({}) every process is one rank; "
                                 "launch more processes instead",
                                 a.ranks, comm::env_source_name(launch->source)),
                     2);
    }
    o.launch = *launch;
  }
  const int rank = o.launch ? o.launch->rank : 0;
  const bool speak = !a.quiet && rank == 0;
  if (rank != 0) log::logger().set_level(spdlog::level::err);  // rank 0 warns for the run
  o.sample_bytes = a.sample;
  o.export_path = a.export_path;
  o.log_json = a.log_json;
  o.save_dir = a.save_dir;
  o.save_every = a.save_every;
  o.keep = a.keep;
  o.resume = a.resume;
  o.init_from = a.init_from;
  // A DeepSpeed JSON config sets what it names; flags given on the command line win; what
  // neither sets is the table's default (or zinf train's own).
  std::optional<config::Config> cfg;
  if (!a.config.empty()) {
    auto loaded = config::load_config(a.config);
    if (!loaded.is_ok()) throw CliError(loaded.status().detail(), 2);
    cfg = std::move(*loaded);
  }
  const int world = o.launch ? o.launch->world_size : o.ranks;
  const TrainSettings ts = build_train_settings(a.tunables.given(), cfg ? &*cfg : nullptr, world,
                                                {.hidden = o.model.dim, .steps = a.steps});
  o.engine = ts.engine;
  o.lr_schedule = ts.config.scheduler;
  o.batch = ts.batch;
  o.seed = ts.seed;  // one seed for the initialisation, the data order and the sample
  const EngineSettings& e = o.engine;
  // Under a launcher each process writes its own trace: rank r's name gets ".rank<r>" before its
  // extension (rank 0 keeps the name).
  const std::string trace_path = rank == 0 ? ts.trace : with_rank_suffix(ts.trace, rank);
  for (const std::string& p : e.nvme_paths) {
    std::error_code ec;
    std::filesystem::create_directories(p, ec);
  }
  // Before the space check: what dead runs left there is counted as free.
  remove_stale_swap_directories(e.nvme_paths);
  if (!trace_path.empty()) {
    if (Status s = gpt::check_output_file("--trace", trace_path); !s.is_ok()) {
      throw CliError(s.detail(), 2);
    }
  }
  if (Status s = gpt::check_train_options(o); !s.is_ok()) throw CliError(s.detail(), 2);

  const bool tty = ::isatty(STDERR_FILENO) && speak;
  std::unique_ptr<std::ofstream> log;
  if (!a.log_json.empty() && rank == 0) {
    log = std::make_unique<std::ofstream>(a.log_json, std::ios::trunc);
    if (!*log) throw CliError("cannot write " + a.log_json, 2);
    *log << settings_log_line(ts).dump() << "\n";  // the first line; then one per step
    log->flush();
  }
  if (speak) {
    std::printf("zinf train: %s, %d rank%s%s, ZeRO stage %d, %s, params on %s, optimizer on %s\n",
                gpt::describe(o.model).c_str(), world, world == 1 ? "" : "s",
                o.launch ? fmt::format(" ({}, {} backend)", comm::env_source_name(o.launch->source),
                                       comm::backend_name(o.launch->backend))
                               .c_str()
                         : "",
                e.stage, dtype_name(e.dtype).data(), tier_name(e.param_home).data(),
                tier_name(e.optimizer_home).data());
    std::printf("%s", a.show_settings ? settings_block(ts).c_str() : settings_line(ts).c_str());
    if (!o.init_from.empty()) std::printf("initial weights from %s\n", o.init_from.c_str());
    std::fflush(stdout);
  }
  auto on_step = [&](const gpt::StepLog& s, int total) {
    double nvme_rate =
        s.seconds > 0 ? static_cast<double>(s.nvme_read + s.nvme_written) / s.seconds : 0;
    if (tty) {
      int width = 24, done = static_cast<int>(static_cast<double>(s.step) / total * width);
      std::fprintf(stderr, "\r[%s%s] step %lld/%d  loss %.4f  %.0f tok/s  NVMe %s   ",
                   std::string(done, '#').c_str(), std::string(width - done, '.').c_str(),
                   static_cast<long long>(s.step), total, s.loss, s.tokens_per_s,
                   format_rate(nvme_rate).c_str());
      std::fflush(stderr);
    } else if (speak && (s.step == 1 || s.step % 20 == 0 || s.step == total)) {
      std::printf("step %lld/%d  loss %.4f  %.0f tok/s  NVMe %s\n", static_cast<long long>(s.step),
                  total, s.loss, s.tokens_per_s, format_rate(nvme_rate).c_str());
      std::fflush(stdout);
    }
    if (log) {
      nlohmann::json j = {
          {"step", s.step},
          {"loss", s.loss},
          {"tokens_per_s", s.tokens_per_s},
          {"seconds", s.seconds},
          {"skipped", s.skipped},
          {"grad_norm", s.grad_norm},
          {"lr", s.lr},
          {"beta1", s.beta1},
          {"beta2", s.beta2},
          {"nvme_read_bytes", s.nvme_read},
          {"nvme_written_bytes", s.nvme_written},
          {"nvme_read_minimum_bytes", s.nvme_minimum.read_bytes},
          {"nvme_written_minimum_bytes", s.nvme_minimum.written_bytes},
          {"nvme_gradient_spill_minimum_bytes", s.nvme_minimum.gradient_spill_bytes},
          {"param_gather_elements", s.comm.param_gather_elements},
          {"grad_reduce_elements", s.comm.grad_reduce_elements},
          {"gathers_on_demand", s.schedule.gathers_on_demand},
          {"gathers_ahead", s.schedule.gathers_ahead},
          {"uses_served_ahead", s.schedule.uses_served_ahead},
          {"uses_served_kept", s.schedule.uses_served_kept},
          {"peak_live_elements", s.schedule.peak_live_elements},
          {"units_updated_early", s.units_updated_early},
          {"followed_trace", s.schedule.following},
          {"departures", s.schedule.departures},
          {"sub_groups", s.schedule.sub_groups},
          {"peak_rss_bytes", peak_rss_bytes()}};
      for (int t = 0; t < kNumTiers; ++t) {
        j["bytes_" + std::string(tier_name(static_cast<Tier>(t)))] = s.memory.tiers[t].current;
        j["peak_bytes_" + std::string(tier_name(static_cast<Tier>(t)))] = s.memory.tiers[t].peak;
      }
      *log << j.dump() << "\n";
      log->flush();
    }
  };
  // The budgets each rank runs with, once the engine has chosen them (docs/engine.md, Budgets).
  uint64_t host_budget = 0;  // rank 0's, once the engine has chosen it
  auto on_start = [&](const EngineSettings& effective, const Budgets& b) {
    host_budget = b.host_bytes;
    if (speak) {
      std::printf("budgets per rank: device %s (%s), host %s (%s)\n",
                  format_bytes(static_cast<double>(b.device_bytes)).c_str(),
                  b.device_reason.c_str(), format_bytes(static_cast<double>(b.host_bytes)).c_str(),
                  b.host_reason.c_str());
      std::fflush(stdout);
    }
    if (log) {
      *log << nlohmann::json{{"budgets",
                              {{"device_bytes", b.device_bytes},
                               {"device_reason", b.device_reason},
                               {"host_bytes", b.host_bytes},
                               {"host_reason", b.host_reason},
                               {"dtype", dtype_name(effective.dtype)}}}}
                  .dump()
           << "\n";
      log->flush();
    }
  };
  // SIGINT / SIGTERM: stop after the current step (saving with --save-dir), exit 128 + signal.
  // Before any thread starts (the trace writer's included): they inherit the blocked mask.
  SignalWatcher signals(e.nvme_paths);
  o.stop = &signals.received();
  if (!trace_path.empty()) trace::start(trace_path);
  auto report = gpt::train(o, on_step, on_start);
  if (tty) std::fprintf(stderr, "\n");
  if (!trace_path.empty()) {
    Status ts = trace::stop();
    if (!ts.is_ok()) throw CliError(ts.detail());
    if (!a.quiet)  // every process wrote one
      std::printf("trace written to %s (open it in ui.perfetto.dev)\n", trace_path.c_str());
  }
  if (!report.is_ok()) {
    const int sig = signals.received().load();
    if (sig != 0 && report.status().code() == ErrorCode::kCancelled) {
      throw CliError(report.status().detail(), 128 + sig);
    }
    throw CliError(report.status().detail());
  }
  if (const int sig = signals.received().load(); sig != 0) {
    throw CliError("stopped by a signal after the last step", 128 + sig);
  }
  if (log) {  // every rank's memory row (peaks over the run)
    nlohmann::json rows = nlohmann::json::array();
    for (size_t r = 0; r < report->memory.size(); ++r) {
      nlohmann::json row = {{"rank", r}};
      for (int t = 0; t < kNumTiers; ++t) {
        row["peak_bytes_" + std::string(tier_name(static_cast<Tier>(t)))] =
            report->memory[r].tiers[t].peak;
      }
      rows.push_back(std::move(row));
    }
    *log << nlohmann::json{{"memory_per_rank", rows}}.dump() << "\n";
    log->flush();
  }
  if (!speak) return;
  auto rate = [](uint64_t bytes, double seconds) {
    return format_rate(seconds > 0 ? static_cast<double>(bytes) / seconds : 0);
  };
  if (!report->resumed_path.empty()) {
    std::printf("resumed from %s at step %lld (loaded %s in %.2f s: %s)\n",
                report->resumed_path.c_str(), static_cast<long long>(report->resumed_from),
                format_bytes(static_cast<double>(report->load_bytes)).c_str(), report->load_seconds,
                rate(report->load_bytes, report->load_seconds).c_str());
  }
  if (!report->last_checkpoint.empty()) {
    std::printf("last checkpoint: %s (%d saved: %s in %.2f s, %s)\n",
                report->last_checkpoint.c_str(), report->saves,
                format_bytes(static_cast<double>(report->save_bytes)).c_str(), report->save_seconds,
                rate(report->save_bytes, report->save_seconds).c_str());
  }
  if (report->steps.empty()) {
    std::printf("no step taken (--steps %d)\n", o.steps);
  } else {
    std::printf("loss %.4f -> %.4f (chance: %.4f)\n", report->initial_loss, report->final_loss,
                std::log(256.0));
  }
  print_memory_table(*report, e.dtype);
  std::printf("  peak resident memory of this process: %s\n",
              format_bytes(static_cast<double>(peak_rss_bytes())).c_str());
  if (!report->steps.empty()) {
    const gpt::StepLog& last = report->steps.back();
    const ScheduleReport& sr = last.schedule;
    std::printf(
        "\nScheduler, last step (rank 0): %s; uses served by all-gathers issued ahead %llu, "
        "by kept units %llu, on demand %llu; %zu optimizer sub-group%s",
        sr.following ? "followed the recorded order" : "recording the order",
        static_cast<unsigned long long>(sr.uses_served_ahead),
        static_cast<unsigned long long>(sr.uses_served_kept),
        static_cast<unsigned long long>(sr.gathers_on_demand), sr.sub_groups,
        sr.sub_groups == 1 ? "" : "s");
    if (e.overlap_optimizer) {
      std::printf("; %zu unit update%s overlapped with the backward pass", last.units_updated_early,
                  last.units_updated_early == 1 ? "" : "s");
    }
    std::printf("\n");
    // Against the least the placement must move (docs/offload.md, "The traffic minimum"). That
    // minimum counts nothing as cached in host memory, so it is only a floor when the state homed
    // on NVMe (what the minimum writes) is larger than the host budget.
    const NvmeTraffic& m = last.nvme_minimum;
    if (m.written_bytes > host_budget) {
      std::printf(
          "NVMe, last step (rank 0): read %s (%.2fx the minimum, %s); written %s (%.2fx, %s)",
          format_bytes(static_cast<double>(last.nvme_read)).c_str(),
          static_cast<double>(last.nvme_read) / static_cast<double>(m.read_bytes),
          format_bytes(static_cast<double>(m.read_bytes)).c_str(),
          format_bytes(static_cast<double>(last.nvme_written)).c_str(),
          static_cast<double>(last.nvme_written) / static_cast<double>(m.written_bytes),
          format_bytes(static_cast<double>(m.written_bytes)).c_str());
      // The gradients that must wait for the norm and do not fit the host budget.
      if (m.gradient_spill_bytes > 0) {
        const auto spill = static_cast<double>(m.gradient_spill_bytes);
        std::printf(
            "; %.2fx and %.2fx the least at this host budget, where %s of gradients wait "
            "on NVMe",
            static_cast<double>(last.nvme_read) / (static_cast<double>(m.read_bytes) + spill),
            static_cast<double>(last.nvme_written) / (static_cast<double>(m.written_bytes) + spill),
            format_bytes(spill).c_str());
      }
      std::printf("\n");
    }
  }
  if (!a.export_path.empty()) std::printf("\nexported fp32 weights to %s\n", a.export_path.c_str());
  if (a.sample > 0) std::printf("\nsample:\n%s\n", report->sample.c_str());
}

const Registration kTrain{
    "", "train", "Train the GPT example through the Engine (ZeRO stages 0-3, CPU/NVMe offload)",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--config", a->config,
                     "DeepSpeed JSON config (zero_optimization, optimizer, fp16/bf16, aio, ...); "
                     "flags given here win");
      sub.add_option("--model", a->model, "Preset: tiny, small, gpt2-124m, 1b, 2b")
          ->capture_default_str();
      sub.add_option("--layers", a->layers, "Override the number of blocks");
      sub.add_option("--dim", a->dim, "Override the model width");
      sub.add_option("--heads", a->heads, "Override the number of attention heads");
      sub.add_option("--seq", a->seq, "Override the context length");
      sub.add_option("--steps", a->steps, "Optimizer steps (0: only with --init-from)")
          ->capture_default_str();
      sub.add_option("--data", a->data, "Text file to train on (default: the fortunes corpus)");
      sub.add_option("--ranks", a->ranks,
                     "Data-parallel ranks as local threads (under mpirun, srun or torchrun-style "
                     "variables each process is one rank: docs/multi-node.md)")
          ->capture_default_str();
      a->tunables.add_to(sub);  // the table's flags (--stage, --lr, --offload-param, ...)
      sub.add_option("--log-json", a->log_json,
                     "Write the effective settings ({\"settings\": ...}), the budgets chosen "
                     "({\"budgets\": ...}), one JSON object per step and every rank's memory "
                     "peaks ({\"memory_per_rank\": ...}) to this file (rank 0 writes it)");
      sub.add_option("--export", a->export_path, "Write the final fp32 weights (.safetensors)");
      sub.add_option("--save-dir", a->save_dir,
                     "Save checkpoints here (step-<N>/, and `latest`): every --save-every steps "
                     "and after the last step (docs/checkpoints.md)");
      sub.add_option("--save-every", a->save_every,
                     "Steps between checkpoints (0 = only after the last step)")
          ->capture_default_str();
      sub.add_option("--keep", a->keep, "Keep the newest K checkpoints (0 = all)")
          ->capture_default_str();
      sub.add_option("--resume", a->resume,
                     "Resume from a checkpoint: its directory, a --save-dir root, or `latest` "
                     "(the newest under --save-dir); --steps stays the total");
      sub.add_option("--init-from", a->init_from,
                     "Start from these weights (.safetensors from --export or `zinf checkpoint "
                     "export`; F32, BF16 or F16) instead of the initialiser: every parameter, "
                     "with its shape, and nothing else. A new run (step 0, fresh optimizer "
                     "state), not with --resume; --steps 0 takes no step (then --export or "
                     "--save-dir writes the weights as loaded)");
      sub.add_option("--sample", a->sample, "Generate this many bytes of text at the end");
      sub.add_flag("--quiet", a->quiet, "Print nothing but errors");
      sub.add_flag("--show-settings", a->show_settings,
                   "Print every setting at start-up, each marked where it came from (by default "
                   "one line names those not left at the table's default)");
      sub.add_flag("--describe", a->describe,
                   "Print the model's shape and parameter count as JSON and exit");
      sub.callback([a, &sub] { run(*a, sub); });
    }};

}  // namespace
}  // namespace zinf::cli
