// `zinf bench store`: NVMe -> pinned staging -> device through the tiered store, against a plain
// `zinf bench io` read of the same path, alternating, medians. `--checksum compare` instead sets
// the store's moves with swap checksums against the same moves without them.
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
  std::string checksum = "on";  // swap checksums: on (zinf's default), off, compare (both)
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

// One store over its own swap space, device and pinned pool, holding the bench's tensors.
struct Rig {
  Ledger ledger;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<Device> device;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<TieredTensorStore> store;
  std::unique_ptr<Stream> fill_stream;
  std::vector<TensorId> ids;
};

std::unique_ptr<Rig> make_rig(io::IoEngine& engine, const std::string& path, uint64_t total,
                              uint64_t tensor, uint64_t staging, bool checksum) {
  auto rig = std::make_unique<Rig>();
  auto swap = io::SwapSpace::create(engine, {.directories = {path}, .checksum = checksum});
  if (!swap.is_ok()) throw CliError(swap.status().detail(), 2);
  rig->swap = std::move(*swap);
  rig->device = make_cpu_device({.budget_bytes = tensor + (64ull << 20), .ledger = &rig->ledger});
  rig->pool = std::make_unique<PinnedPool>(PinnedPoolOptions{
      .budget_bytes = 8 * staging + (64ull << 20), .engine = &engine, .ledger = &rig->ledger});
  auto store = TieredTensorStore::create({.device = rig->device.get(),
                                          .host = rig->pool.get(),
                                          .swap = rig->swap.get(),
                                          .ledger = &rig->ledger,
                                          .staging_bytes = staging,
                                          .movers = 1});
  if (!store.is_ok()) throw CliError(store.status().detail());
  rig->store = std::move(*store);
  rig->fill_stream = rig->device->create_stream("bench-fill");
  for (uint64_t done = 0; done < total; done += tensor) {
    auto id = rig->store->create_tensor({.name = "bench" + std::to_string(rig->ids.size()),
                                         .bytes = std::min(tensor, total - done),
                                         .home = Tier::kNvme});
    if (!id.is_ok()) throw CliError(id.status().detail());
    rig->ids.push_back(*id);
  }
  return rig;
}

// Write then read every tensor of the rig: bytes per second each way.
std::pair<double, double> rig_pass(Rig& rig, uint64_t seed) {
  auto sw = store_write_pass(*rig.store, *rig.device, *rig.fill_stream, rig.ids, seed);
  if (!sw.is_ok()) throw CliError(sw.status().detail());
  auto st = store_pass(*rig.store, rig.ids);
  if (!st.is_ok()) throw CliError(st.status().detail());
  return {*sw, *st};
}

// --checksum compare: the same moves with and without swap checksums, alternating, medians.
void run_checksum_compare(const Args& a, io::IoEngine& engine, uint64_t total, uint64_t tensor,
                          uint64_t staging) {
  auto on = make_rig(engine, a.path, total, tensor, staging, true);
  auto off = make_rig(engine, a.path, total, tensor, staging, false);
  std::vector<double> r_on, r_off, w_on, w_off, r_ratio, w_ratio;
  for (int i = 0; i < a.runs; ++i) {
    // Alternate which goes first, so neither always reads what was written last.
    auto first = i % 2 == 0 ? on.get() : off.get();
    auto second = i % 2 == 0 ? off.get() : on.get();
    auto [w1, r1] = rig_pass(*first, static_cast<uint64_t>(i) + 1);
    auto [w2, r2] = rig_pass(*second, static_cast<uint64_t>(i) + 1);
    const bool on_first = first == on.get();
    w_on.push_back(on_first ? w1 : w2);
    r_on.push_back(on_first ? r1 : r2);
    w_off.push_back(on_first ? w2 : w1);
    r_off.push_back(on_first ? r2 : r1);
    r_ratio.push_back(r_on.back() / r_off.back());
    w_ratio.push_back(w_on.back() / w_off.back());
  }
  if (a.json) {
    nlohmann::json j = {{"bytes", total},
                        {"tensor_bytes", tensor},
                        {"staging_bytes", staging},
                        {"queue_depth", a.queue_depth},
                        {"read_checksum_on_bytes_per_s", r_on},
                        {"read_checksum_off_bytes_per_s", r_off},
                        {"read_median_ratio_on_off", median(r_ratio)},
                        {"write_checksum_on_bytes_per_s", w_on},
                        {"write_checksum_off_bytes_per_s", w_off},
                        {"write_median_ratio_on_off", median(w_ratio)}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench store: %s of %s tensors, checksums on vs off (%s staging, qd %lld)\n",
              format_bytes(static_cast<double>(total)).c_str(),
              format_bytes(static_cast<double>(tensor)).c_str(),
              format_bytes(static_cast<double>(staging)).c_str(),
              static_cast<long long>(a.queue_depth));
  std::printf("  NVMe -> device: on %s, off %s, ratio on/off %.3f\n",
              format_rate(median(r_on)).c_str(), format_rate(median(r_off)).c_str(),
              median(r_ratio));
  std::printf("  device -> NVMe: on %s, off %s, ratio on/off %.3f\n",
              format_rate(median(w_on)).c_str(), format_rate(median(w_off)).c_str(),
              median(w_ratio));
  std::printf("  (medians of %d alternating runs)\n", a.runs);
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
  if (a.checksum != "on" && a.checksum != "off" && a.checksum != "compare") {
    throw CliError("--checksum must be on, off or compare, got '" + a.checksum + "'", 2);
  }
  io::IoBenchOptions io_opts{.directories = {a.path},
                             .size = total,
                             .block_size = 1 << 20,
                             .queue_depth = static_cast<uint32_t>(a.queue_depth),
                             .pattern = io::BenchPattern::kRead};
  if (Status s = io::validate_io_bench(io_opts); !s.is_ok()) throw CliError(s.detail(), 2);

  auto engine = io::IoEngine::create(
      {.queue_depth = static_cast<uint32_t>(a.queue_depth), .block_size = 1 << 20});
  if (!engine.is_ok()) throw CliError(engine.status().detail());
  if (a.checksum == "compare") {
    run_checksum_compare(a, **engine, total, tensor, staging);
    return;
  }
  auto rig = make_rig(**engine, a.path, total, tensor, staging, a.checksum == "on");
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
    auto [sw, st] = rig_pass(*rig, static_cast<uint64_t>(i) + 1);
    io_rates.push_back(io->bytes_per_s);
    store_rates.push_back(st);
    ratios.push_back(st / io->bytes_per_s);
    wio_rates.push_back(iow->bytes_per_s);
    wstore_rates.push_back(sw);
    wratios.push_back(sw / iow->bytes_per_s);
  }
  if (a.json) {
    nlohmann::json j = {{"bytes", total},
                        {"tensor_bytes", tensor},
                        {"staging_bytes", staging},
                        {"queue_depth", a.queue_depth},
                        {"checksum", a.checksum == "on"},
                        {"read_store_bytes_per_s", store_rates},
                        {"read_io_bytes_per_s", io_rates},
                        {"read_median_ratio", median(ratios)},
                        {"write_store_bytes_per_s", wstore_rates},
                        {"write_io_bytes_per_s", wio_rates},
                        {"write_median_ratio", median(wratios)}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf(
      "zinf bench store: %s of %s tensors, NVMe -> pinned (%s staging) -> device, checksums %s\n",
      format_bytes(static_cast<double>(total)).c_str(),
      format_bytes(static_cast<double>(tensor)).c_str(),
      format_bytes(static_cast<double>(staging)).c_str(), a.checksum.c_str());
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
      sub.add_option("--checksum", a->checksum,
                     "Swap block checksums: on (the default, as zinf.checksum), off, or compare "
                     "(the store's moves with and without them, alternating; ratio on/off)");
      sub.add_flag("--json", a->json, "Print one JSON object");
      sub.callback([a] { run(*a); });
    }};

}  // namespace
}  // namespace zinf::cli
