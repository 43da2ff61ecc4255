// `zinf bench device`: the device backend's own speeds, through the Device contract the engine
// uses: host -> device and device -> host copies (copy_async, the host side registered with the
// device as the host tier's buffers are: pinned on CUDA), a device -> device copy (the
// yardstick), and the Adam step on device-resident state against that yardstick (its traffic,
// 16 bytes read and 12 written per fp32 parameter, at the device's copy bandwidth). Medians of
// alternating runs. `--device cpu` measures the CPU device (RAM); `--device cuda` a GPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "command.h"
#include "zinf/core/units.h"
#include "zinf/memory/device.h"

namespace zinf::cli {
namespace {

struct Args {
  std::string device = "cpu";
  std::string size = "256M";
  int runs = 7;
  bool json = false;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void run(const Args& a) {
  const auto kind = parse_device_kind(a.device);
  if (!kind || *kind == DeviceKind::kAuto) {
    throw CliError("--device must be cpu, cpu-strict or cuda, got '" + a.device + "'", 2);
  }
  const uint64_t bytes = align_up(bytes_flag("--size", a.size), 4096);
  if (bytes == 0) throw CliError("--size must be positive", 2);
  if (a.runs < 1) throw CliError("--runs must be at least 1", 2);
  const uint64_t n = bytes / 4;  // fp32 parameters of the Adam step
  // Adam state (param, m, v, grad: 4 arrays of n floats) and the copy pair share the budget.
  auto made = make_device(*kind, {.budget_bytes = 6 * bytes + (1ull << 20)});
  if (!made.is_ok()) throw CliError(made.status().detail(), 1);
  Device& dev = **made;
  auto stream = dev.create_stream("bench");
  auto alloc = [&](uint64_t b) {
    auto r = dev.allocate(b, MemoryCategory::kBuffers);
    if (!r.is_ok()) throw CliError(r.status().detail(), 1);
    return std::move(r).value();
  };
  DeviceBuffer x = alloc(bytes), y = alloc(bytes);
  DeviceBuffer param = alloc(bytes), m = alloc(bytes), v = alloc(bytes), grad = alloc(bytes);
  // The host side is registered with the device as the engine's host tier is (PinnedPool): on
  // CUDA pinned, so the copies run at the link's speed.
  std::vector<char> host(bytes, 1);
  if (Status st = dev.register_host(host.data(), bytes); !st.is_ok()) {
    throw CliError(st.detail(), 1);
  }
  struct Unregister {
    Device& dev;
    void* p;
    ~Unregister() { dev.unregister_host(p); }
  } unregister{dev, host.data()};
  for (DeviceBuffer* b : {&x, &y, &param, &m, &v, &grad}) {
    dev.fill({b->data(), DType::kF32, n}, 0.25f, *stream);
  }
  auto sync = [&] {
    if (Status s = stream->synchronize(); !s.is_ok()) throw CliError(s.detail(), 1);
  };
  sync();
  auto timed = [&](auto&& op) {
    const double t0 = now();
    op();
    sync();
    return now() - t0;
  };
  const kernels::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  int64_t step = 0;
  auto adam = [&] {
    dev.adam(cfg, {.step = ++step},
             {.param = static_cast<float*>(param.data()),
              .m = static_cast<float*>(m.data()),
              .v = static_cast<float*>(v.data()),
              .grad = grad.data(),
              .n = n},
             *stream);
  };
  std::vector<double> h2d, d2h, d2d, adam_s;
  timed(adam);  // warm-up: first touch, page migration
  timed([&] { dev.copy_async(x.data(), host.data(), bytes, *stream); });
  timed([&] { dev.copy_async(host.data(), x.data(), bytes, *stream); });
  timed([&] { dev.copy_async(y.data(), x.data(), bytes, *stream); });
  for (int r = 0; r < a.runs; ++r) {  // alternating, so drift weighs on every series alike
    h2d.push_back(timed([&] { dev.copy_async(x.data(), host.data(), bytes, *stream); }));
    d2h.push_back(timed([&] { dev.copy_async(host.data(), x.data(), bytes, *stream); }));
    d2d.push_back(timed([&] { dev.copy_async(y.data(), x.data(), bytes, *stream); }));
    adam_s.push_back(timed(adam));
  }
  const double b = static_cast<double>(bytes);
  const double h2d_bps = b / median(h2d), d2h_bps = b / median(d2h);
  const double d2d_bps = 2 * b / median(d2d);                              // read + write
  const double adam_bps = 28.0 * static_cast<double>(n) / median(adam_s);  // 16 read, 12 written
  if (a.json) {
    nlohmann::json j = {{"device", dev.name()},
                        {"bytes", bytes},
                        {"runs", a.runs},
                        {"host_to_device_bytes_per_s", h2d_bps},
                        {"device_to_host_bytes_per_s", d2h_bps},
                        {"device_copy_bytes_per_s", d2d_bps},
                        {"adam_bytes_per_s", adam_bps},
                        {"adam_over_device_copy", adam_bps / d2d_bps},
                        {"adam_params_per_s", static_cast<double>(n) / median(adam_s)}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench device: %s, %s per transfer, medians of %d alternating runs\n",
              dev.name().c_str(), format_bytes(b).c_str(), a.runs);
  std::printf("  host -> device   %s\n", format_rate(h2d_bps).c_str());
  std::printf("  device -> host   %s\n", format_rate(d2h_bps).c_str());
  std::printf("  device copy      %s (read + write)\n", format_rate(d2d_bps).c_str());
  std::printf("  adam             %s (28 bytes per parameter), %.3f of the device copy\n",
              format_rate(adam_bps).c_str(), adam_bps / d2d_bps);
}

const Registration kReg{
    "bench", "device",
    "Copy bandwidth (host <-> device, device copy) and the Adam step against it, through the "
    "device backend",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.add_option("--device", a->device, "cpu, cpu-strict or cuda")->capture_default_str();
      sub.add_option("--size", a->size, "Bytes per transfer (and fp32 Adam state per array)")
          ->capture_default_str();
      sub.add_option("--runs", a->runs, "Alternating runs (medians)")->capture_default_str();
      sub.add_flag("--json", a->json, "Print one JSON object");
      sub.callback([a] { run(*a); });
    }};

}  // namespace
}  // namespace zinf::cli
