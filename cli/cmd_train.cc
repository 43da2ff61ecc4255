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
#include "zinf/core/trace.h"
#include "zinf/core/units.h"
#include "zinf/engine/settings.h"
#include "zinf/gpt/trainer.h"

namespace zinf::cli {
namespace {

struct Args {
  std::string model = "small";
  int layers = 0, dim = 0, heads = 0, seq = 0;
  int batch = 8;
  int steps = 200;
  double lr = 3e-3;
  uint64_t seed = 1;
  std::string data;
  int ranks = 1;
  int stage = 3;
  std::string offload_param = "none";
  std::string offload_optimizer = "none";
  std::vector<std::string> nvme_paths;
  std::string dtype = "fp32";
  std::string device_mem, host_mem;
  int grad_accum = 1;
  double clip = 1.0;
  std::string config;
  std::string trace, log_json, export_path;
  int sample = 0;
  bool quiet = false;
  bool describe = false;
  std::string prefetch_bucket, max_live, reuse_distance, sub_group;
  bool overlap_optimizer = false;
};

// Peak resident set size of this process, in bytes.
uint64_t peak_rss_bytes() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

Tier parse_offload(const std::string& flag, const std::string& v) {
  if (v == "none") return Tier::kDevice;
  if (v == "cpu") return Tier::kHost;
  if (v == "nvme") return Tier::kNvme;
  throw CliError(flag + " must be none, cpu or nvme, got '" + v + "'", 2);
}

void print_memory_table(const gpt::TrainReport& r, DType dtype) {
  const double P = static_cast<double>(r.padded_parameters);
  // Plain data parallelism holds everything on every rank: params and grads in the working
  // dtype, fp32 master (mixed precision), m and v.
  const double wsize = static_cast<double>(dtype_size(dtype));
  const double plain = P * (2 * wsize + (wsize == 4 ? 0 : 4) + 8);
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
  auto given = [&](const char* flag) { return sub.count(flag) > 0; };
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
  o.batch = a.batch;
  o.steps = a.steps;
  o.seed = a.seed;
  o.data = a.data;
  o.mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  o.ranks = a.ranks;
  o.sample_bytes = a.sample;
  o.export_path = a.export_path;
  o.log_json = a.log_json;
  EngineSettings& e = o.engine;
  std::string trace_path = a.trace;
  // A DeepSpeed JSON config sets the defaults; flags given on the command line win.
  bool from_config = !a.config.empty();
  if (from_config) {
    auto cfg = config::load_config(a.config);
    if (!cfg.is_ok()) throw CliError(cfg.status().detail(), 2);
    int world = o.mpi ? std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")) : o.ranks;
    if (Status s = config::resolve_batch_sizes(*cfg, world); !s.is_ok()) {
      throw CliError(s.detail(), 2);
    }
    if (Status s = config::validate(*cfg, world); !s.is_ok()) throw CliError(s.detail(), 2);
    auto settings = settings_from_config(*cfg);
    if (!settings.is_ok()) throw CliError(settings.status().detail(), 2);
    e = *settings;
    if (!given("--batch")) o.batch = static_cast<int>(cfg->train_micro_batch_size_per_gpu);
    if (!given("--seed") && cfg->zinf.seed) o.seed = cfg->zinf.seed;  // zinf.seed in the config
    if (!given("--trace")) trace_path = cfg->zinf.trace;
  } else {
    e.adam.weight_decay = 0.01f;
  }
  if (!from_config || given("--stage")) e.stage = a.stage;
  if (e.stage < 0 || e.stage > 3) throw CliError("--stage must be 0..3", 2);
  if (!from_config || given("--dtype")) {
    auto dt = parse_dtype(a.dtype);
    if (!dt) throw CliError("--dtype must be fp32, bf16 or fp16, got '" + a.dtype + "'", 2);
    e.dtype = *dt;
  }
  if (!from_config || given("--lr")) e.adam.lr = static_cast<float>(a.lr);
  if (!from_config || given("--clip")) e.gradient_clipping = static_cast<float>(a.clip);
  if (!from_config || given("--grad-accum")) e.gradient_accumulation_steps = a.grad_accum;
  if (!from_config || given("--offload-param")) {
    e.param_home = parse_offload("--offload-param", a.offload_param);
  }
  if (!from_config || given("--offload-optimizer")) {
    e.optimizer_home = parse_offload("--offload-optimizer", a.offload_optimizer);
  }
  if (e.param_home != Tier::kDevice && e.stage != 3) {
    throw CliError("parameter offload needs ZeRO stage 3", 2);
  }
  if (!from_config || given("--nvme-path")) e.nvme_paths = a.nvme_paths;
  if (!a.prefetch_bucket.empty()) {
    e.prefetch_bucket_elements = elements_flag("--prefetch-bucket", a.prefetch_bucket);
  }
  if (!a.max_live.empty()) e.max_live_elements = elements_flag("--max-live", a.max_live);
  if (!a.reuse_distance.empty()) {
    e.max_reuse_distance = elements_flag("--reuse-distance", a.reuse_distance);
  }
  if (!a.sub_group.empty()) e.sub_group_elements = elements_flag("--sub-group", a.sub_group);
  if (a.overlap_optimizer) e.overlap_optimizer = true;
  for (const std::string& p : e.nvme_paths) {
    std::error_code ec;
    std::filesystem::create_directories(p, ec);
  }
  if (!a.device_mem.empty()) e.device_mem = bytes_flag("--device-mem", a.device_mem);
  if (!a.host_mem.empty()) e.host_mem = bytes_flag("--host-mem", a.host_mem);
  e.seed = o.seed;  // one seed for the initialisation, the data order and the sample
  if (Status s = gpt::check_train_options(o); !s.is_ok()) throw CliError(s.detail(), 2);

  const bool tty = ::isatty(STDERR_FILENO) && !a.quiet;
  std::unique_ptr<std::ofstream> log;
  if (!a.log_json.empty()) {
    log = std::make_unique<std::ofstream>(a.log_json, std::ios::trunc);
    if (!*log) throw CliError("cannot write " + a.log_json, 2);
  }
  if (!a.quiet) {
    std::printf("zinf train: %s, %s rank%s, ZeRO stage %d, %s, params on %s, optimizer on %s\n",
                gpt::describe(o.model).c_str(),
                o.mpi ? std::getenv("OMPI_COMM_WORLD_SIZE") : std::to_string(o.ranks).c_str(),
                o.ranks == 1 && !o.mpi ? "" : "s", e.stage, a.dtype.c_str(),
                tier_name(e.param_home).data(), tier_name(e.optimizer_home).data());
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
    } else if (!a.quiet && (s.step == 1 || s.step % 20 == 0 || s.step == total)) {
      std::printf("step %lld/%d  loss %.4f  %.0f tok/s  NVMe %s\n", static_cast<long long>(s.step),
                  total, s.loss, s.tokens_per_s, format_rate(nvme_rate).c_str());
      std::fflush(stdout);
    }
    if (log) {
      nlohmann::json j = {{"step", s.step},
                          {"loss", s.loss},
                          {"tokens_per_s", s.tokens_per_s},
                          {"seconds", s.seconds},
                          {"skipped", s.skipped},
                          {"grad_norm", s.grad_norm},
                          {"nvme_read_bytes", s.nvme_read},
                          {"nvme_written_bytes", s.nvme_written},
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
  if (!trace_path.empty()) trace::start(trace_path);
  auto report = gpt::train(o, on_step);
  if (tty) std::fprintf(stderr, "\n");
  if (!trace_path.empty()) {
    Status ts = trace::stop();
    if (!ts.is_ok()) throw CliError(ts.detail());
    if (!a.quiet)
      std::printf("trace written to %s (open it in ui.perfetto.dev)\n", trace_path.c_str());
  }
  if (!report.is_ok()) throw CliError(report.status().detail());
  if (a.quiet) return;
  std::printf("loss %.4f -> %.4f (chance: %.4f)\n", report->initial_loss, report->final_loss,
              std::log(256.0));
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
      sub.add_option("--model", a->model, "Preset: tiny, small, gpt2-124m, 1b, 2b (default small)");
      sub.add_option("--layers", a->layers, "Override the number of blocks");
      sub.add_option("--dim", a->dim, "Override the model width");
      sub.add_option("--heads", a->heads, "Override the number of attention heads");
      sub.add_option("--seq", a->seq, "Override the context length");
      sub.add_option("--batch", a->batch, "Sequences per rank per micro-step (default 8)");
      sub.add_option("--steps", a->steps, "Optimizer steps (default 200)");
      sub.add_option("--lr", a->lr, "Learning rate (default 3e-3)");
      sub.add_option("--seed", a->seed, "Seed of the initialisation and the data order");
      sub.add_option("--data", a->data, "Text file to train on (default: the fortunes corpus)");
      sub.add_option("--ranks", a->ranks, "Data-parallel ranks as local threads (default 1)");
      sub.add_option("--stage", a->stage, "ZeRO stage 0..3 (default 3)");
      sub.add_option("--offload-param", a->offload_param, "none | cpu | nvme (stage 3)");
      sub.add_option("--offload-optimizer", a->offload_optimizer, "none | cpu | nvme");
      sub.add_option("--nvme-path", a->nvme_paths, "Swap directory (repeatable: striped)");
      sub.add_option("--dtype", a->dtype, "fp32 | bf16 | fp16 working precision (default fp32)");
      sub.add_option("--prefetch-bucket", a->prefetch_bucket,
                     "Stage 3: parameter elements all-gathered ahead along the recorded order "
                     "(stage3_prefetch_bucket_size; default 5e7, 0 = off)");
      sub.add_option("--max-live", a->max_live,
                     "Stage 3: parameter elements gathered at once (stage3_max_live_parameters; "
                     "default 1e9, and at most half of --device-mem)");
      sub.add_option("--reuse-distance", a->reuse_distance,
                     "Stage 3: keep a unit gathered when it is used again within this many "
                     "elements (stage3_max_reuse_distance; default 1e9, 0 = never)");
      sub.add_option("--sub-group", a->sub_group,
                     "Optimizer sub-group size in elements (sub_group_size; default 1e9, capped "
                     "to a third of --host-mem with the optimizer offloaded; 0 = one per unit, "
                     "uncapped)");
      sub.add_flag("--overlap-optimizer", a->overlap_optimizer,
                   "Start each unit's optimizer update during the backward pass once its "
                   "gradients are final (only with --clip 0 and without fp16; otherwise a "
                   "warning and no effect)");
      sub.add_option("--device-mem", a->device_mem, "Device budget per rank, e.g. 2G");
      sub.add_option("--host-mem", a->host_mem, "Pinned host budget per rank, e.g. 4G");
      sub.add_option("--grad-accum", a->grad_accum, "Micro-steps per step (default 1)");
      sub.add_option("--clip", a->clip, "Global gradient-norm clipping, 0 = off (default 1.0)");
      sub.add_option("--trace", a->trace,
                     "Write a Chrome/Perfetto trace (tracks per rank: compute, comm, copy, NVMe "
                     "read/write, CPU Adam)");
      sub.add_option("--log-json", a->log_json, "Write one JSON object per step to this file");
      sub.add_option("--export", a->export_path, "Write the final fp32 weights (.safetensors)");
      sub.add_option("--sample", a->sample, "Generate this many bytes of text at the end");
      sub.add_flag("--quiet", a->quiet, "Print nothing but errors");
      sub.add_flag("--describe", a->describe,
                   "Print the model's shape and parameter count as JSON and exit");
      sub.callback([a, &sub] { run(*a, sub); });
    }};

}  // namespace
}  // namespace zinf::cli
