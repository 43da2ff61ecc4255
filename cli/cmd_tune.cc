// `zinf tune`: measures this machine's NVMe path and CPU optimizer and writes the settings that
// reach them as a config fragment `zinf train --config` accepts unchanged.
//
//  - the I/O engine: block size, queue depth, rings and registered buffers, for writes and reads
//    (each trial writes a file and reads it back, both timed), on each path and striped across
//    all of them, by the pruned walk of tune_search.h within the time budget;
//  - the CPU Adam per thread count, against the memory bandwidth of the same traffic;
//  - the fragment: the aio block and zinf.io_fixed_buffers (the chosen I/O setting), the staging
//    piece (enough pieces in flight to keep the queue full), sub_group_size (three groups of
//    optimizer state fit in the share of RAM an NVMe run keeps for the host), and
//    zinf.optimizer_threads (the fewest threads within 3% of the fastest).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "command.h"
#include "tune_search.h"
#include "zinf/config/config.h"
#include "zinf/core/state_bytes.h"
#include "zinf/core/tunables.h"
#include "zinf/core/units.h"
#include "zinf/engine/budgets.h"
#include "zinf/io/aligned_buffer.h"
#include "zinf/io/io_bench.h"
#include "zinf/kernels/cpu_adam.h"

namespace zinf::cli {
namespace {

namespace k = kernels;

struct Args {
  std::vector<std::string> paths;
  std::string size = "256M";
  double budget = 120;
  std::string out, plot;
  int ranks = 1;
  std::string adam_params = "16e6";
  std::string max_in_flight = "64M";
  bool json = false;
};

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string gbps(double bytes_per_s) { return fmt::format("{:.3f}", bytes_per_s / 1e9); }

// One search: a path, or every path striped.
struct Target {
  std::string name;
  std::vector<std::string> directories;
  IoSearchResult result;
};

struct AdamRow {
  int threads = 0;
  double seconds = 0;  // median per step
  double bytes_per_s = 0;
};

// The CPU Adam on `n` fp32 parameters at every thread count up to the cores, and the streaming
// bandwidth of the same traffic with every core (medians of 3, after a warm-up step).
std::pair<std::vector<AdamRow>, double> measure_adam(size_t n) {
  io::AlignedBuffer param(n * 4), m(n * 4), v(n * 4), grad(n * 4);
  if (!param || !m || !v || !grad) throw CliError("cannot allocate the Adam benchmark's arrays", 1);
  for (auto* b : {&param, &m, &v, &grad}) std::memset(b->data(), 0, n * 4);
  const k::AdamTensors t{.param = reinterpret_cast<float*>(param.data()),
                         .m = reinterpret_cast<float*>(m.data()),
                         .v = reinterpret_cast<float*>(v.data()),
                         .grad = grad.data(),
                         .grad_dtype = DType::kF32,
                         .n = n};
  const double bytes = static_cast<double>(k::adam_step_bytes(t));
  const k::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  auto timed = [](auto&& fn) {
    std::vector<double> s;
    fn();  // warm-up
    for (int i = 0; i < 3; ++i) {
      const double t0 = now_seconds();
      fn();
      s.push_back(now_seconds() - t0);
    }
    return median(s);
  };
  const int cores = k::resolve_threads(0);
  std::vector<AdamRow> rows;
  int64_t step = 0;
  for (int threads = 1; threads <= cores; ++threads) {
    const double s =
        timed([&] { k::adam_step(cfg, {.step = ++step, .grad_scale = 1.0f}, t, threads); });
    rows.push_back({.threads = threads, .seconds = s, .bytes_per_s = bytes / s});
  }
  const double stream = bytes / timed([&] { k::adam_traffic_roofline(t, cores); });
  return {rows, stream};
}

// The fewest threads within 3% of the fastest.
int choose_threads(const std::vector<AdamRow>& rows) {
  double best = 0;
  for (const auto& r : rows) best = std::max(best, r.bytes_per_s);
  for (const auto& r : rows) {
    if (r.bytes_per_s >= 0.97 * best) return r.threads;
  }
  return rows.empty() ? 0 : rows.back().threads;
}

// The staging piece: with `buffers` pieces in flight per move, enough bytes that the queue stays
// full (queue depth x block size), in whole MiB.
uint64_t choose_staging_bytes(const IoSetting& s, uint64_t buffers) {
  const uint64_t in_flight = s.block_size * s.queue_depth;
  return std::max<uint64_t>(align_up((in_flight + buffers - 1) / buffers, 1 << 20), 1 << 20);
}

// sub_group_size: three groups of optimizer state (16 bytes per element in mixed precision: fp32
// master, m, v and the gradient accumulator) fit in the host share an NVMe run keeps (an eighth
// of MemAvailable per machine, split over its ranks); at most DeepSpeed's 1e9, in whole 1 Mi
// elements.
uint64_t choose_sub_group(const MachineMemory& machine, int ranks, std::string& why) {
  const uint64_t share = machine.available_bytes / 8 / static_cast<uint64_t>(std::max(ranks, 1));
  uint64_t elements =
      share / (3 * optimizer_state_bytes_per_element(DType::kBF16, Accumulator::kIncluded));
  elements = std::min<uint64_t>(elements, tunables::kSubGroup.value);
  elements = std::max<uint64_t>(elements / (1 << 20), 1) * (1 << 20);
  why = fmt::format(
      "three groups of 16 bytes per element in 1/8 of MemAvailable ({}) over {} "
      "rank(s)",
      format_bytes(static_cast<double>(machine.available_bytes)), ranks);
  return elements;
}

// gnuplot: throughput against block size (a line per queue depth) and against queue depth (a
// line per block size), from the sweeps' single-ring registered trials of `target`.
void plot(const std::string& path, const Target& target) {
  const bool png = path.ends_with(".png");
  if (!png && !path.ends_with(".svg")) throw CliError("--plot needs a .svg or .png file", 2);
  // The sweeps' single-ring registered trials, best score per setting, as one data block per
  // series (sorted along its x axis): by queue depth for the block-size plot, by block size for
  // the queue-depth plot.
  std::map<std::pair<uint64_t, uint32_t>, double> score;  // (block KiB, depth) -> GB/s
  for (const IoTrial& t : target.result.trials) {
    if (t.phase == "confirm" || t.setting.rings != 1 || !t.setting.fixed_buffers) continue;
    double& s = score[{t.setting.block_size / 1024, t.setting.queue_depth}];
    s = std::max(s, t.measured.score() / 1e9);
  }
  std::map<uint32_t, std::vector<std::pair<uint64_t, double>>> by_depth;
  std::map<uint64_t, std::vector<std::pair<uint32_t, double>>> by_block;
  for (const auto& [key, gb] : score) {
    by_depth[key.second].emplace_back(key.first, gb);
    by_block[key.first].emplace_back(key.second, gb);
  }
  const std::string data = path + ".dat";
  std::string plot_blocks, plot_depths;
  {
    std::ofstream d(data, std::ios::trunc);
    int index = 0;
    auto block = [&](const auto& rows, const std::string& title, std::string& plot) {
      for (const auto& [x, gb] : rows) d << x << " " << gb << "\n";
      d << "\n\n";
      plot += fmt::format("{}'{}' index {} using 1:2 with linespoints title '{}'",
                          plot.empty() ? "plot " : ", ", data, index++, title);
    };
    for (auto& [depth, rows] : by_depth) {
      std::sort(rows.begin(), rows.end());
      block(rows, fmt::format("depth {}", depth), plot_blocks);
    }
    for (auto& [kib, rows] : by_block) {
      std::sort(rows.begin(), rows.end());
      block(rows, fmt::format("{} KiB", kib), plot_depths);
    }
    if (!d.flush()) throw CliError("cannot write " + data, 1);
  }
  const std::string script = path + ".gp";
  {
    std::ofstream g(script, std::ios::trunc);
    g << (png ? "set terminal pngcairo size 1200,450\n" : "set terminal svg size 1200,450\n")
      << "set output '" << path << "'\n"
      << "set multiplot layout 1,2 title 'zinf tune: " << target.name
      << " (score: 2 reads : 1 write; best of the sweeps)'\n"
      << "set grid\nset key top left\nset ylabel 'GB/s'\nset logscale x 2\n"
      << "set xlabel 'block size (KiB)'\n"
      << plot_blocks << "\n"
      << "set xlabel 'queue depth'\n"
      << plot_depths << "\n"
      << "unset multiplot\n";
    if (!g.flush()) throw CliError("cannot write " + script, 1);
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    throw CliError("gnuplot is not installed (make deps installs it); the data is in " + data, 1);
  }
  const std::string cmd = "gnuplot '" + script + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) throw CliError("gnuplot failed on " + script, 1);
}

void run(const Args& a) {
  if (a.paths.empty()) throw CliError("--nvme-path is required", 2);
  if (!(a.budget >= 10)) throw CliError("--budget must be at least 10 seconds", 2);
  if (a.ranks < 1) throw CliError("--ranks-per-node must be at least 1", 2);
  const uint64_t size = bytes_flag("--size", a.size);
  const uint64_t adam_n = elements_flag("--adam-params", a.adam_params);
  const uint64_t max_in_flight = bytes_flag("--max-in-flight", a.max_in_flight);
  if (max_in_flight < (1u << 20)) throw CliError("--max-in-flight must be at least 1M", 2);
  if (adam_n == 0) throw CliError("--adam-params must be at least 1", 2);
  for (const std::string& p : a.paths) {
    io::IoBenchOptions check{.directories = {p}, .size = size};
    if (Status s = io::validate_io_bench(check); !s.is_ok()) throw CliError(s.detail(), 2);
  }
  auto machine = read_machine_memory();
  if (!machine.is_ok()) throw CliError(machine.status().detail(), 1);

  std::vector<Target> targets;
  for (const std::string& p : a.paths) targets.push_back({.name = p, .directories = {p}});
  if (a.paths.size() > 1) {
    targets.push_back(
        {.name = fmt::format("striped over {} paths", a.paths.size()), .directories = a.paths});
  }
  const double start = now_seconds();
  // The I/O searches share 85% of the budget; the CPU measurements take the rest.
  const double io_share = 0.85 * a.budget / static_cast<double>(targets.size());
  const bool tty = ::isatty(STDERR_FILENO) && !a.json;
  const uint32_t cores = std::max(1u, std::thread::hardware_concurrency());

  if (!a.json) {
    std::printf("zinf tune: %zu path(s), %s per trial (written, then read back), budget %.0f s\n",
                a.paths.size(), format_bytes(static_cast<double>(size)).c_str(), a.budget);
    std::printf("%-28s %-11s %9s %6s %5s %5s %10s %10s %10s\n", "target", "phase", "block", "depth",
                "rings", "reg", "read GB/s", "write GB/s", "score GB/s");
  }
  for (Target& target : targets) {
    io::IoBenchOptions base{.directories = target.directories,
                            .size = size,
                            .pattern = io::BenchPattern::kWrite,
                            .time_read_back = true};
    MeasureIo measure = [&](const IoSetting& s) -> Result<IoMeasurement> {
      io::IoBenchOptions o = base;
      o.block_size = s.block_size;
      o.queue_depth = s.queue_depth;
      o.threads = s.rings;
      o.fixed_buffers = s.fixed_buffers;
      o.size = std::max<uint64_t>(align_up(size, s.block_size * s.rings), s.block_size * s.rings);
      ZINF_ASSIGN_OR_RETURN(io::IoBenchResult r, io::run_io_bench(o));
      return IoMeasurement{.read_bytes_per_s = r.read_back_bytes_per_s,
                           .write_bytes_per_s = r.bytes_per_s};
    };
    IoSearchOptions opts{.max_rings = std::min<uint32_t>(cores, 4),
                         .budget_seconds = io_share,
                         .max_in_flight_bytes = max_in_flight};
    opts.on_trial = [&](const IoTrial& t) {
      if (tty) std::fprintf(stderr, "\r%80s\r", "");
      if (!a.json) {
        std::printf("%-28s %-11s %9s %6u %5u %5s %10s %10s %10s\n",
                    target.name.substr(0, 28).c_str(), t.phase.c_str(),
                    format_bytes(static_cast<double>(t.setting.block_size)).c_str(),
                    t.setting.queue_depth, t.setting.rings, t.setting.fixed_buffers ? "yes" : "no",
                    gbps(t.measured.read_bytes_per_s).c_str(),
                    gbps(t.measured.write_bytes_per_s).c_str(), gbps(t.measured.score()).c_str());
        std::fflush(stdout);
      }
      if (tty) {
        const double el = now_seconds() - start;
        const int width = 30, done = std::min(width, static_cast<int>(el / a.budget * width));
        std::fprintf(stderr, "[%s%s] %.0f / %.0f s", std::string(done, '#').c_str(),
                     std::string(width - done, '.').c_str(), el, a.budget);
        std::fflush(stderr);
      }
    };
    auto r = search_io(measure, opts);
    if (tty) std::fprintf(stderr, "\r%80s\r", "");
    if (!r.is_ok()) throw CliError(fmt::format("{}: {}", target.name, r.status().detail()), 1);
    target.result = std::move(*r);
  }

  const auto [adam_rows, stream_bps] = measure_adam(adam_n);
  const int threads = choose_threads(adam_rows);
  const Target& chosen_target = targets.back();  // striped when there are several paths
  const IoSetting& io = chosen_target.result.chosen;
  std::string sub_group_why;
  const uint64_t sub_group = choose_sub_group(*machine, a.ranks, sub_group_why);
  const uint64_t staging = choose_staging_bytes(io, tunables::kStagingBuffers.value);
  const double elapsed = now_seconds() - start;

  nlohmann::ordered_json fragment = {
      {"aio",
       {{"block_size", io.block_size},
        {"queue_depth", io.queue_depth},
        {"intra_op_parallelism", io.rings},
        {"single_submit", false}}},
      {"zero_optimization",
       {{"sub_group_size", sub_group},
        {"offload_param", {{"buffer_count", tunables::kParamBufferCount.value}}},
        {"offload_optimizer", {{"buffer_count", tunables::kStagingBuffers.value}}}}},
      {"zinf",
       {{"staging_bytes", staging},
        {"optimizer_threads", threads},
        {"io_fixed_buffers", io.fixed_buffers}}}};
  // What zinf train will read: the fragment must parse and check as a config.
  if (auto cfg = config::parse_config_text(fragment.dump()); !cfg.is_ok()) {
    throw CliError("internal: the tuned fragment is not a valid config: " + cfg.status().detail(),
                   1);
  }
  if (!a.out.empty()) {
    std::ofstream out(a.out, std::ios::trunc);
    out << fragment.dump(2) << "\n";
    if (!out.flush()) throw CliError("cannot write " + a.out, 1);
  }
  if (!a.plot.empty()) plot(a.plot, chosen_target);

  if (a.json) {
    nlohmann::ordered_json j;
    j["seconds"] = elapsed;
    j["budget_seconds"] = a.budget;
    for (const Target& t : targets) {
      nlohmann::ordered_json trials = nlohmann::ordered_json::array();
      for (const IoTrial& x : t.result.trials) {
        trials.push_back({{"phase", x.phase},
                          {"block_size", x.setting.block_size},
                          {"queue_depth", x.setting.queue_depth},
                          {"rings", x.setting.rings},
                          {"fixed_buffers", x.setting.fixed_buffers},
                          {"read_bytes_per_s", x.measured.read_bytes_per_s},
                          {"write_bytes_per_s", x.measured.write_bytes_per_s},
                          {"score_bytes_per_s", x.measured.score()}});
      }
      auto setting = [](const IoSetting& s) {
        return nlohmann::ordered_json{{"block_size", s.block_size},
                                      {"queue_depth", s.queue_depth},
                                      {"rings", s.rings},
                                      {"fixed_buffers", s.fixed_buffers}};
      };
      j["targets"].push_back({{"name", t.name},
                              {"directories", t.directories},
                              {"trials", trials},
                              {"best_tried", setting(t.result.best_tried)},
                              {"chosen", setting(t.result.chosen)},
                              {"chosen_median_score_bytes_per_s", t.result.chosen_median_score},
                              {"confirm_rounds", t.result.confirm_rounds},
                              {"budget_ran_out", t.result.budget_ran_out}});
    }
    for (const AdamRow& r : adam_rows) {
      j["adam"].push_back({{"threads", r.threads},
                           {"seconds_per_step", r.seconds},
                           {"bytes_per_s", r.bytes_per_s},
                           {"roofline_ratio", r.bytes_per_s / stream_bps}});
    }
    j["stream_bytes_per_s"] = stream_bps;
    j["config"] = fragment;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("\nCPU Adam, %s fp32 parameters (%d core%s; streaming the same traffic: %s GB/s):\n",
              format_count(static_cast<double>(adam_n)).c_str(), static_cast<int>(cores),
              cores == 1 ? "" : "s", gbps(stream_bps).c_str());
  std::printf("  %-8s %10s %10s %10s\n", "threads", "ms/step", "GB/s", "vs stream");
  for (const AdamRow& r : adam_rows) {
    std::printf("  %-8d %10.2f %10s %10.3f\n", r.threads, r.seconds * 1e3,
                gbps(r.bytes_per_s).c_str(), r.bytes_per_s / stream_bps);
  }
  std::printf("\nchosen (%s): %s; median score %s GB/s over %d confirmation round%s",
              chosen_target.name.c_str(), describe(io).c_str(),
              gbps(chosen_target.result.chosen_median_score).c_str(),
              chosen_target.result.confirm_rounds,
              chosen_target.result.confirm_rounds == 1 ? "" : "s");
  if (chosen_target.result.best_tried != io) {
    std::printf(" (the best single trial, %s, did not hold up)",
                describe(chosen_target.result.best_tried).c_str());
  }
  std::printf("\n  staging_bytes %s: %u pieces in flight cover depth x block size\n",
              format_bytes(static_cast<double>(staging)).c_str(), tunables::kStagingBuffers.value);
  std::printf("  sub_group_size %llu: %s\n", static_cast<unsigned long long>(sub_group),
              sub_group_why.c_str());
  std::printf("  optimizer_threads %d: the fewest within 3%% of the fastest\n", threads);
  if (chosen_target.result.budget_ran_out) {
    std::printf("  (the budget ended the sweeps early: a larger --budget tries more settings)\n");
  }
  std::printf("finished in %.0f s of a %.0f s budget\n", elapsed, a.budget);
  std::printf("\nzinf train --config accepts%s:\n%s\n",
              a.out.empty() ? "" : (" (written to " + a.out + ")").c_str(),
              fragment.dump(2).c_str());
}

const Registration kReg{
    "", "tune",
    "Measure this machine's NVMe path (block size, queue depth, rings, registered buffers) and CPU "
    "Adam, and write the settings as a config fragment",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--nvme-path", a->paths,
                     "Directory to measure (repeatable: each alone, then striped across all)")
          ->required();
      sub.add_option("--size", a->size, "Bytes written and read back per trial")
          ->capture_default_str();
      sub.add_option("--budget", a->budget, "Seconds the whole tuning may take (at least 10)")
          ->capture_default_str();
      sub.add_option("--out", a->out, "Write the config fragment to this file");
      sub.add_option("--plot", a->plot,
                     "Draw throughput against block size and queue depth (.svg or .png; gnuplot)");
      sub.add_option("--ranks-per-node", a->ranks,
                     "Ranks that will share this machine (sizes sub_group_size)")
          ->capture_default_str();
      sub.add_option("--adam-params", a->adam_params, "Parameters of the CPU Adam measurement")
          ->capture_default_str();
      sub.add_option("--max-in-flight", a->max_in_flight,
                     "Most bytes in flight a setting may keep (block size x depth x rings); the "
                     "staging piece chosen covers it")
          ->capture_default_str();
      sub.add_flag("--json", a->json, "Print every trial, the Adam rows and the fragment as JSON");
      sub.callback([a] { run(*a); });
    }};

}  // namespace
}  // namespace zinf::cli
