// `zinf bench store`: NVMe -> pinned staging -> device through the tiered store, against a plain
// `zinf bench io` read of the same path, alternating, medians.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "command.h"
#include "zinf/core/units.h"
#include "zinf/io/io_bench.h"
#include "zinf/store/tiered_store.h"

namespace zinf::cli {
namespace {

struct Args {
  std::string path;
  std::string size = "1G";
  std::string tensor_size = "256M";
  std::string staging = "8M";
  int64_t queue_depth = 16;
  int runs = 3;
  bool json = false;
};

// Device -> NVMe: every tensor written on the device, then written back; bytes per second.
// The device is written through its own operation (a fill), as every user of device memory does.
Result<double> store_write_pass(TieredTensorStore& store, Device& device, Stream& stream,
                                const std::vector<TensorId>& ids, uint64_t seed) {
  double seconds = 0;
  uint64_t bytes = 0;
  for (TensorId id : ids) {
    {
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, store.acquire(id, Tier::kDevice, Access::kOverwrite));
      device.fill({.data = h.data(), .dtype = DType::kF32, .numel = h.bytes() / 4},
                  static_cast<float>(seed), stream);
      ZINF_RETURN_IF_ERROR(stream.synchronize());
      h.mark_dirty();
      bytes += h.bytes();
    }
    auto t0 = std::chrono::steady_clock::now();
    ZINF_RETURN_IF_ERROR(store.evict(id, Tier::kDevice));
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return static_cast<double>(bytes) / seconds;
}

// NVMe -> device: every tensor moved once; returns bytes per second.
Result<double> store_pass(TieredTensorStore& store, const std::vector<TensorId>& ids) {
  for (TensorId id : ids) ZINF_RETURN_IF_ERROR(store.evict(id, Tier::kDevice));
  auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  for (TensorId id : ids) {
    ZINF_ASSIGN_OR_RETURN(TensorHandle h, store.acquire(id, Tier::kDevice));
    bytes += h.bytes();
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(bytes) / s;
}

void run(const Args& a) {
  const uint64_t total = bytes_flag("--size", a.size);
  const uint64_t tensor = bytes_flag("--tensor-size", a.tensor_size);
  const uint64_t staging = bytes_flag("--staging", a.staging);
  if (tensor == 0 || total < tensor) throw CliError("--tensor-size must be 1..--size", 2);
  if (staging == 0 || staging % (1 << 20) != 0) {
    throw CliError("--staging must be a positive multiple of 1M", 2);
  }
  if (a.queue_depth < 1 || a.runs < 1) throw CliError("--queue-depth and --runs must be >= 1", 2);
  io::IoBenchOptions io_opts{.directories = {a.path},
                             .size = total,
                             .block_size = 1 << 20,
                             .queue_depth = static_cast<uint32_t>(a.queue_depth),
                             .pattern = io::BenchPattern::kRead};
  if (Status s = io::validate_io_bench(io_opts); !s.is_ok()) throw CliError(s.detail(), 2);

  auto engine = io::IoEngine::create(
      {.queue_depth = static_cast<uint32_t>(a.queue_depth), .block_size = 1 << 20});
  if (!engine.is_ok()) throw CliError(engine.status().detail());
  auto swap = io::SwapSpace::create(**engine, {.directories = {a.path}});
  if (!swap.is_ok()) throw CliError(swap.status().detail(), 2);
  Ledger ledger;
  auto device = make_cpu_device({.budget_bytes = tensor + (64ull << 20), .ledger = &ledger});
  PinnedPool pool(
      {.budget_bytes = 8 * staging + (64ull << 20), .engine = engine->get(), .ledger = &ledger});
  auto store = TieredTensorStore::create({.device = device.get(),
                                          .host = &pool,
                                          .swap = swap->get(),
                                          .ledger = &ledger,
                                          .staging_bytes = staging,
                                          .movers = 1});
  if (!store.is_ok()) throw CliError(store.status().detail());
  auto fill_stream = device->create_stream("bench-fill");
  std::vector<TensorId> ids;
  for (uint64_t done = 0; done < total; done += tensor) {
    auto id = (*store)->create_tensor({.name = "bench" + std::to_string(ids.size()),
                                       .bytes = std::min(tensor, total - done),
                                       .home = Tier::kNvme});
    if (!id.is_ok()) throw CliError(id.status().detail());
    ids.push_back(*id);
  }
  // Each run: bench io writes and reads its file, then the store writes every tensor back and
  // reads it in again, so both read data written equally recently.
  std::vector<double> store_rates, io_rates, ratios, wstore_rates, wio_rates, wratios;
  for (int i = 0; i < a.runs; ++i) {
    io::IoBenchOptions w = io_opts;
    w.pattern = io::BenchPattern::kWrite;
    auto iow = io::run_io_bench(w);
    if (!iow.is_ok()) throw CliError(iow.status().detail());
    auto io = io::run_io_bench(io_opts);
    if (!io.is_ok()) throw CliError(io.status().detail());
    auto sw = store_write_pass(**store, *device, *fill_stream, ids, static_cast<uint64_t>(i) + 1);
    if (!sw.is_ok()) throw CliError(sw.status().detail());
    auto st = store_pass(**store, ids);
    if (!st.is_ok()) throw CliError(st.status().detail());
    io_rates.push_back(io->bytes_per_s);
    store_rates.push_back(*st);
    ratios.push_back(*st / io->bytes_per_s);
    wio_rates.push_back(iow->bytes_per_s);
    wstore_rates.push_back(*sw);
    wratios.push_back(*sw / iow->bytes_per_s);
  }
  if (a.json) {
    nlohmann::json j = {{"bytes", total},
                        {"tensor_bytes", tensor},
                        {"staging_bytes", staging},
                        {"queue_depth", a.queue_depth},
                        {"read_store_bytes_per_s", store_rates},
                        {"read_io_bytes_per_s", io_rates},
                        {"read_median_ratio", median(ratios)},
                        {"write_store_bytes_per_s", wstore_rates},
                        {"write_io_bytes_per_s", wio_rates},
                        {"write_median_ratio", median(wratios)}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench store: %s of %s tensors, NVMe -> pinned (%s staging) -> device\n",
              format_bytes(static_cast<double>(total)).c_str(),
              format_bytes(static_cast<double>(tensor)).c_str(),
              format_bytes(static_cast<double>(staging)).c_str());
  std::printf("  NVMe -> device: store %s, bench io read (1M, qd %lld) %s, ratio %.3f\n",
              format_rate(median(store_rates)).c_str(), static_cast<long long>(a.queue_depth),
              format_rate(median(io_rates)).c_str(), median(ratios));
  std::printf("  device -> NVMe: store %s, bench io write (1M, qd %lld) %s, ratio %.3f\n",
              format_rate(median(wstore_rates)).c_str(), static_cast<long long>(a.queue_depth),
              format_rate(median(wio_rates)).c_str(), median(wratios));
  std::printf("  (medians of %d alternating runs)\n", a.runs);
}

const Registration kBenchStore{
    "bench", "store", "Measure NVMe -> pinned -> device moves of the tiered store vs bench io",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--path", a->path, "Swap directory to test")->required();
      sub.add_option("--size", a->size, "Total bytes of tensors (default 1G)");
      sub.add_option("--tensor-size", a->tensor_size, "Bytes per tensor (default 256M)");
      sub.add_option("--staging", a->staging, "Staging piece size (default 8M)");
      sub.add_option("--queue-depth", a->queue_depth, "I/O queue depth (default 16)");
      sub.add_option("--runs", a->runs, "Alternating runs (default 3)");
      sub.add_flag("--json", a->json, "Print one JSON object");
      sub.callback([a] { run(*a); });
    }};

}  // namespace
}  // namespace zinf::cli
