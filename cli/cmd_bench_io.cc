// `zinf bench io`: measure an NVMe path with the same engine the runtime swaps through.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "command.h"
#include "zinf/core/units.h"
#include "zinf/io/io_bench.h"

namespace zinf::cli {
namespace {

struct Args {
  std::vector<std::string> paths;
  std::string size = "1G";
  std::string block_size = "1M";
  int64_t queue_depth = 32;
  std::string rw = "read";
  int64_t threads = 1;
  bool json = false;
  bool no_fixed_buffers = false;
  bool no_defer_taskrun = false;
};

void run(const Args& a) {
  io::IoBenchOptions o;
  o.directories = a.paths;
  o.size = bytes_flag("--size", a.size);
  o.block_size = bytes_flag("--block-size", a.block_size);
  if (a.queue_depth <= 0) throw CliError("--queue-depth must be at least 1", 2);
  if (a.threads <= 0) throw CliError("--threads must be at least 1", 2);
  o.queue_depth = static_cast<uint32_t>(a.queue_depth);
  o.threads = static_cast<uint32_t>(a.threads);
  o.fixed_buffers = !a.no_fixed_buffers;
  o.defer_taskrun = !a.no_defer_taskrun;
  auto pattern = io::parse_pattern(a.rw);
  if (!pattern.is_ok()) throw CliError(pattern.status().message(), 2);
  o.pattern = *pattern;
  if (Status s = io::validate_io_bench(o); !s.is_ok()) throw CliError(s.detail(), 2);

  const bool tty = ::isatty(STDERR_FILENO);
  io::IoBenchProgress progress;
  if (tty) {
    progress = [](const char* phase, uint64_t done, uint64_t total, double seconds) {
      double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
      std::fprintf(stderr, "\r  %-9s %10s / %-10s %12s   ", phase,
                   format_bytes(static_cast<double>(done)).c_str(),
                   format_bytes(static_cast<double>(total)).c_str(), format_rate(rate).c_str());
      std::fflush(stderr);
    };
  }
  auto r = io::run_io_bench(o, progress);
  if (tty) std::fprintf(stderr, "\r%70s\r", "");
  if (!r.is_ok()) throw CliError(r.status().detail());

  if (a.json) {
    nlohmann::json j = {{"rw", a.rw},
                        {"block_size", o.block_size},
                        {"queue_depth", o.queue_depth},
                        {"threads", o.threads},
                        {"bytes", r->bytes},
                        {"seconds", r->seconds},
                        {"bytes_per_s", r->bytes_per_s},
                        {"iops", r->iops},
                        {"direct", r->direct},
                        {"fixed_buffers", o.fixed_buffers},
                        {"defer_taskrun", r->deferred},
                        {"verified_bytes", r->verified_sectors * 4096},
                        {"paths", a.paths}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::string paths;
  for (const std::string& p : a.paths) paths += (paths.empty() ? "" : " + ") + p;
  std::printf("zinf bench io: %s %s on %s (%s, io_uring)\n", a.rw.c_str(),
              format_bytes(static_cast<double>(o.size)).c_str(), paths.c_str(),
              r->direct ? "O_DIRECT" : "buffered: O_DIRECT refused");
  std::printf("  %-11s %-12s %-8s %-9s %-13s %s\n", "block size", "queue depth", "threads",
              "seconds", "throughput", "IOPS");
  std::printf("  %-11s %-12u %-8u %-9.3f %-13s %.0f\n",
              format_bytes(static_cast<double>(o.block_size)).c_str(), o.queue_depth, o.threads,
              r->seconds, format_rate(r->bytes_per_s).c_str(), r->iops);
  std::printf("  verified %s read back against what was written; file removed\n",
              format_bytes(static_cast<double>(r->verified_sectors * 4096)).c_str());
}

const Registration kBenchIo{
    "bench", "io", "Measure read/write throughput of a path through zinf's io_uring engine",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--path", a->paths,
                     "Directory to test (a file is created and removed); repeatable: blocks are "
                     "striped across the directories' files")
          ->required();
      sub.add_option("--size", a->size, "Bytes to transfer, e.g. 4G (default 1G)");
      sub.add_option("--block-size", a->block_size,
                     "Bytes per request, e.g. 1M, 128K (default 1M)");
      sub.add_option("--queue-depth", a->queue_depth, "Requests in flight per thread (default 32)");
      sub.add_option("--rw", a->rw, "read | write | randread | randwrite (default read)");
      sub.add_option("--threads", a->threads, "Rings, each with its own thread (default 1)");
      sub.add_flag("--json", a->json, "Print one JSON object instead of the table");
      sub.add_flag("--no-fixed-buffers", a->no_fixed_buffers,
                   "Do not register the buffers with io_uring");
      sub.add_flag("--no-defer-taskrun", a->no_defer_taskrun,
                   "Create the rings without IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN");
      sub.callback([a] { run(*a); });
    }};

}  // namespace
}  // namespace zinf::cli
