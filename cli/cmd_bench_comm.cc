// `zinf bench comm`: bandwidth of one collective, reported the way nccl-tests defines it.
//   algbw = size / time, where size is the full buffer (all_gather's output, reduce_scatter's
//           input, all_reduce's buffer) and time is the slowest rank's mean time per operation;
//   busbw = algbw * (n-1)/n for all_gather and reduce_scatter, algbw * 2(n-1)/n for all_reduce:
//           the per-rank wire rate of a ring, comparable across world sizes and with the
//           hardware's link bandwidth.
// Runs the local backend (--ranks threads in this process), the MPI backend when started by
// mpirun, the Gloo backend when started with torchrun's variables (or whatever ZINF_COMM and the
// launcher's variables select).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "command.h"
#include "zinf/comm/factory.h"
#include "zinf/comm/local.h"
#include "zinf/core/units.h"

namespace zinf::cli {
namespace {

using comm::CollectiveOp;
using comm::Communicator;

struct Args {
  int64_t ranks = 2;
  std::string size = "64M";
  std::string op = "all_reduce";
  std::string dtype = "fp32";
  int64_t iters = 20;
  int64_t warmup = 3;
  bool json = false;
};

struct Plan {
  CollectiveOp op;
  DType dtype;
  int world;
  size_t count;       // per-rank chunk (all_gather, reduce_scatter) or the buffer (all_reduce)
  size_t size_bytes;  // the full buffer, after rounding to whole elements and chunks
  int64_t iters;
  int64_t warmup;
};

struct RankResult {
  Status status;
  double seconds_per_op = 0;
  comm::OpCounters counters;  // of one operation
};

// One rank's part: warm up, meet, then `iters` operations issued back to back on the stream.
RankResult run_rank(Communicator& c, const Plan& p) {
  const size_t e = dtype_size(p.dtype);
  const size_t full = p.size_bytes, shard = p.op == CollectiveOp::kAllReduce ? full : p.count * e;
  std::vector<std::byte> send(p.op == CollectiveOp::kAllGather ? shard : full);
  std::vector<std::byte> recv(p.op == CollectiveOp::kReduceScatter ? shard : full);
  auto issue = [&]() -> comm::Work {
    switch (p.op) {
      case CollectiveOp::kAllGather:
        return c.all_gather(send.data(), recv.data(), p.count, p.dtype);
      case CollectiveOp::kReduceScatter:
        return c.reduce_scatter(send.data(), recv.data(), p.count, p.dtype, comm::ReduceOp::kSum);
      default:
        return c.all_reduce(send.data(), recv.data(), p.count, p.dtype, comm::ReduceOp::kSum);
    }
  };
  RankResult r;
  for (int64_t i = 0; i < p.warmup; ++i) {
    if (r.status = issue().wait(); !r.status.is_ok()) return r;
  }
  if (r.status = c.barrier().wait(); !r.status.is_ok()) return r;
  c.reset_counters();
  std::vector<comm::Work> works;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < p.iters; ++i) works.push_back(issue());
  for (const comm::Work& w : works) {
    if (r.status = w.wait(); !r.status.is_ok()) return r;
  }
  r.seconds_per_op =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / p.iters;
  r.counters = c.counters()[p.op];
  return r;
}

[[noreturn]] void fail(const Status& s) { throw CliError(s.to_string()); }

void run(const Args& a, bool ranks_given) {
  Plan p{.iters = a.iters, .warmup = a.warmup};
  if (a.op == "all_gather") {
    p.op = CollectiveOp::kAllGather;
  } else if (a.op == "reduce_scatter") {
    p.op = CollectiveOp::kReduceScatter;
  } else if (a.op == "all_reduce") {
    p.op = CollectiveOp::kAllReduce;
  } else {
    throw CliError("--op must be all_gather, reduce_scatter or all_reduce, not '" + a.op + "'", 2);
  }
  auto dtype = parse_dtype(a.dtype);
  if (!dtype) throw CliError("--dtype must be fp32, bf16 or fp16, not '" + a.dtype + "'", 2);
  p.dtype = *dtype;
  const uint64_t size = bytes_flag("--size", a.size);
  if (a.iters < 1) throw CliError("--iters must be at least 1", 2);
  if (a.warmup < 0) throw CliError("--warmup must be >= 0", 2);

  // The backend: what the launcher implies (mpirun: MPI; RANK/WORLD_SIZE: Gloo), else --ranks
  // local threads.
  auto config = comm::comm_config_from_env();
  if (!config.is_ok()) fail(config.status());
  if (config->backend == comm::Backend::kNccl) {
    // The buffers here are host memory: measure the CPU backend the launcher implies (Gloo for a
    // torchrun-style launch, MPI under mpirun or srun).
    const bool gloo = config->source == comm::EnvSource::kTorchrun &&
                      comm::backend_available(comm::Backend::kGloo);
    if (config->backend_explicit || (!gloo && !comm::backend_available(comm::Backend::kMpi))) {
      throw CliError(
          "zinf bench comm measures the host-memory backends (local, mpi, gloo), not nccl", 2);
    }
    config->backend = gloo ? comm::Backend::kGloo : comm::Backend::kMpi;
  }
  const bool processes = config->backend != comm::Backend::kLocal;
  std::vector<std::unique_ptr<Communicator>> comms;
  if (processes) {
    if (ranks_given && a.ranks != config->world_size) {
      throw CliError("--ranks " + std::to_string(a.ranks) + " but the launcher started " +
                         std::to_string(config->world_size) + " processes",
                     2);
    }
    auto c = comm::create_communicator(*config);
    if (!c.is_ok()) fail(c.status());
    comms.push_back(std::move(c).value());
  } else {
    if (a.ranks < 1 || a.ranks > 1024) throw CliError("--ranks must be in [1, 1024]", 2);
    auto group = comm::make_local_group(static_cast<int>(a.ranks), {.timeout = config->timeout});
    if (!group.is_ok()) fail(group.status());
    comms = std::move(group).value();
  }
  p.world = comms[0]->world_size();

  const size_t e = dtype_size(p.dtype);
  const size_t elements = size / e;
  p.count = p.op == CollectiveOp::kAllReduce ? elements : elements / p.world;
  p.size_bytes = (p.op == CollectiveOp::kAllReduce ? p.count : p.count * p.world) * e;
  if (p.count == 0) {
    throw CliError("--size " + a.size + " is less than one " + std::string(dtype_name(p.dtype)) +
                       " element per rank",
                   2);
  }

  std::vector<RankResult> results(comms.size());
  if (processes) {
    results[0] = run_rank(*comms[0], p);
  } else {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < comms.size(); ++r) {
      threads.emplace_back([&, r] { results[r] = run_rank(*comms[r], p); });
    }
    for (auto& t : threads) t.join();
  }
  for (const RankResult& r : results) {
    if (!r.status.is_ok()) fail(r.status);
  }

  // The slowest rank's time. Across processes: every rank's time, all-gathered.
  double seconds = 0;
  for (const RankResult& r : results) seconds = std::max(seconds, r.seconds_per_op);
  if (processes) {
    std::vector<float> times(p.world);
    float mine = static_cast<float>(seconds);
    Status s = comms[0]->all_gather(&mine, times.data(), 1, DType::kF32).wait();
    if (!s.is_ok()) fail(s);
    seconds = *std::max_element(times.begin(), times.end());
    if (comms[0]->rank() != 0) return;
  }

  const int n = p.world;
  const double factor = p.op == CollectiveOp::kAllReduce ? 2.0 * (n - 1) / n : double(n - 1) / n;
  const double algbw = static_cast<double>(p.size_bytes) / seconds;
  const double busbw = algbw * factor;
  const comm::OpCounters& per_op = results[0].counters;
  const std::string backend(comm::backend_name(comms[0]->backend()));
  const std::string op(comm::collective_name(p.op));
  if (a.json) {
    nlohmann::json j = {
        {"backend", backend},
        {"ranks", n},
        {"op", op},
        {"dtype", std::string(dtype_name(p.dtype))},
        {"size_bytes", p.size_bytes},
        {"count", p.count},
        {"iters", p.iters},
        {"warmup", p.warmup},
        {"time_us", seconds * 1e6},
        {"algbw_gbps", algbw / 1e9},
        {"busbw_gbps", busbw / 1e9},
        {"rank0_bytes_sent_per_op", per_op.calls ? per_op.bytes_sent / per_op.calls : 0},
        {"rank0_bytes_received_per_op", per_op.calls ? per_op.bytes_received / per_op.calls : 0},
    };
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench comm: %s, %s, %d rank%s (%s), %lld iterations after %lld warm-up\n",
              op.c_str(), std::string(dtype_name(p.dtype)).c_str(), n, n == 1 ? "" : "s",
              processes ? backend.c_str() : "local threads", static_cast<long long>(p.iters),
              static_cast<long long>(p.warmup));
  std::printf("  %12s %12s %12s %12s\n", "size", "time", "algbw", "busbw");
  std::printf("  %12s %9.3f ms %12s %12s\n",
              format_bytes(static_cast<double>(p.size_bytes)).c_str(), seconds * 1e3,
              format_rate(algbw).c_str(), format_rate(busbw).c_str());
  std::printf("  algbw = size / time; busbw = algbw * %s (nccl-tests definitions)\n",
              p.op == CollectiveOp::kAllReduce ? "2(n-1)/n" : "(n-1)/n");
}

void setup(CLI::App& sub) {
  auto args = std::make_shared<Args>();
  auto* ranks = sub.add_option("--ranks", args->ranks,
                               "Ranks as threads of this process (under mpirun: the processes)")
                    ->capture_default_str();
  sub.add_option("--size", args->size,
                 "Full buffer size: all_gather's output, reduce_scatter's input, all_reduce's "
                 "buffer (K/M/G: binary multiples)")
      ->capture_default_str();
  sub.add_option("--op", args->op, "all_gather | reduce_scatter | all_reduce")
      ->capture_default_str();
  sub.add_option("--dtype", args->dtype, "fp32 | bf16 | fp16")->capture_default_str();
  sub.add_option("--iters", args->iters, "Timed operations, issued back to back")
      ->capture_default_str();
  sub.add_option("--warmup", args->warmup, "Untimed operations first")->capture_default_str();
  sub.add_flag("--json", args->json, "Print one JSON object");
  sub.callback([args, ranks] { run(*args, ranks->count() > 0); });
}

const Registration kReg{"bench", "comm",
                        "Collective bandwidth (algbw, busbw as nccl-tests defines them): local "
                        "threads, MPI under mpirun, or Gloo with torchrun's variables",
                        &setup};

}  // namespace
}  // namespace zinf::cli
