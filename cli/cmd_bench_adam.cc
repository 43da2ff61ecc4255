// `zinf bench adam`: the CPU Adam step against its roofline, the memory bandwidth of the same
// traffic measured in the same process, on the same arrays, with the same threads and chunks.
// `--device cuda` (or cpu-strict) runs the step through a device backend instead, on state
// resident in its memory, against the device's own copy of the same number of bytes.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "command.h"
#include "zinf/core/dtype.h"
#include "zinf/core/units.h"
#include "zinf/kernels/cpu_adam.h"
#include "zinf/memory/device.h"

namespace zinf::cli {
namespace {

namespace k = zinf::kernels;

struct Args {
  std::string params = "64M";
  int64_t threads = 0;
  std::string precision = "fp32";
  int64_t steps = 9;
  int64_t warmup = 2;
  std::string isa = "auto";
  std::string device = "cpu";
  bool json = false;
};

// Loss scale of the fp16 case: gradients are stored multiplied by it and unscaled by the kernel.
constexpr float kFp16LossScale = 1024.0f;

// Anonymous private memory, advised onto transparent huge pages (as the runtime's pinned pool
// is): both kernels run on the very same pages, so the advice cannot favour either.
class HostArray {
 public:
  explicit HostArray(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw CliError("cannot allocate " + format_bytes(static_cast<double>(bytes_)) +
                     " of host memory for the benchmark");
    }
    ::madvise(p, bytes_, MADV_HUGEPAGE);  // advice only: ignored where THP is off
    data_ = p;
  }
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray() { ::munmap(data_, bytes_); }
  void* data() const { return data_; }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

// A cheap deterministic value in [-1, 1) for element i of stream `stream`.
float pseudo_random(uint64_t i, uint64_t stream) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// Parameters ~0.1, gradients ~1e-3 (times the loss scale in fp16), zero moments. Written by
// `threads` threads, each over its own contiguous part (first touch).
void fill(const k::AdamTensors& t, int threads, float grad_multiplier) {
  auto body = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      t.param[i] = 0.1f * pseudo_random(i, 1);
      t.m[i] = 0.0f;
      t.v[i] = 0.0f;
      const float g = 1e-3f * grad_multiplier * pseudo_random(i, 2);
      switch (t.grad_dtype) {
        case DType::kF32:
          static_cast<float*>(const_cast<void*>(t.grad))[i] = g;
          break;
        case DType::kBF16:
          static_cast<uint16_t*>(const_cast<void*>(t.grad))[i] = f32_to_bf16(g);
          break;
        case DType::kF16:
          static_cast<uint16_t*>(const_cast<void*>(t.grad))[i] = f32_to_f16(g);
          break;
      }
      if (t.param_copy) static_cast<uint16_t*>(t.param_copy)[i] = 0;
    }
  };
  std::vector<std::thread> workers;
  const size_t per = (t.n + threads - 1) / threads;
  for (int w = 0; w < threads; ++w) {
    const size_t begin = std::min(t.n, per * w), end = std::min(t.n, begin + per);
    workers.emplace_back(body, begin, end);
  }
  for (auto& w : workers) w.join();
}

template <class Fn>
double seconds_of(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The Adam step through the device contract (the path the engine takes for device-resident
// optimizer state), against a device -> device copy moving the same bytes (read + written).
void run_on_device(const Args& a, DeviceKind kind, size_t n, DType dtype) {
  const bool mixed = dtype != DType::kF32;
  const uint64_t state = n * 4, grad_bytes = n * dtype_size(dtype);
  const uint64_t traffic = 3 * state + grad_bytes + 3 * state + (mixed ? grad_bytes : 0);
  const uint64_t half = align_up(traffic / 2, 4096);  // the copy reads and writes `half` each
  auto made =
      make_device(kind, {.budget_bytes = 3 * state + 2 * grad_bytes + 2 * half + (16ull << 20)});
  if (!made.is_ok()) throw CliError(made.status().detail(), 1);
  Device& dev = **made;
  auto stream = dev.create_stream("bench adam");
  auto alloc = [&](uint64_t b) {
    auto r = dev.allocate(std::max<uint64_t>(b, 1), MemoryCategory::kOptimizerStates);
    if (!r.is_ok()) throw CliError(r.status().detail(), 1);
    return std::move(r).value();
  };
  DeviceBuffer param = alloc(state), m = alloc(state), v = alloc(state), grad = alloc(grad_bytes);
  DeviceBuffer copy = alloc(mixed ? grad_bytes : 0), x = alloc(half), y = alloc(half);
  const float loss_scale = dtype == DType::kF16 ? kFp16LossScale : 1.0f;
  dev.fill({param.data(), DType::kF32, n}, 0.1f, *stream);
  dev.fill({m.data(), DType::kF32, n}, 0.0f, *stream);
  dev.fill({v.data(), DType::kF32, n}, 0.0f, *stream);
  dev.fill({grad.data(), dtype, n}, 1e-3f * loss_scale, *stream);
  dev.fill({x.data(), DType::kF32, half / 4}, 1.0f, *stream);
  auto sync = [&] {
    if (Status st = stream->synchronize(); !st.is_ok()) throw CliError(st.detail(), 1);
  };
  sync();
  const k::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  int64_t step = 0;
  auto adam = [&] {
    dev.adam(cfg, {.step = ++step, .grad_scale = 1.0f / loss_scale},
             {.param = static_cast<float*>(param.data()),
              .m = static_cast<float*>(m.data()),
              .v = static_cast<float*>(v.data()),
              .grad = grad.data(),
              .grad_dtype = dtype,
              .param_copy = mixed ? copy.data() : nullptr,
              .copy_dtype = dtype,
              .n = n},
             *stream);
    sync();
  };
  auto yardstick = [&] {
    dev.copy_async(y.data(), x.data(), half, *stream);
    sync();
  };
  for (int64_t i = 0; i < a.warmup; ++i) {
    adam();
    yardstick();
  }
  std::vector<double> adam_s, copy_s;
  for (int64_t i = 0; i < a.steps; ++i) {  // ABBA, as on the CPU
    if (i % 2 == 0) {
      adam_s.push_back(seconds_of(adam));
      copy_s.push_back(seconds_of(yardstick));
    } else {
      copy_s.push_back(seconds_of(yardstick));
      adam_s.push_back(seconds_of(adam));
    }
  }
  const double bytes_per_step = static_cast<double>(traffic);
  const double seconds_per_step = median(adam_s);
  const double bytes_per_s = bytes_per_step / seconds_per_step;
  const double copy_bytes_per_s = 2.0 * static_cast<double>(half) / median(copy_s);
  const double ratio = bytes_per_s / copy_bytes_per_s;
  const std::string dtype_name_s(dtype_name(dtype));
  if (a.json) {
    nlohmann::json j = {{"device", dev.name()},
                        {"params", n},
                        {"precision", dtype_name_s},
                        {"steps", a.steps},
                        {"warmup", a.warmup},
                        {"bytes_per_param", bytes_per_step / static_cast<double>(n)},
                        {"seconds_per_step", seconds_per_step},
                        {"params_per_s", static_cast<double>(n) / seconds_per_step},
                        {"bytes_per_s", bytes_per_s},
                        {"device_copy_bytes_per_s", copy_bytes_per_s},
                        {"roofline_ratio", ratio},
                        {"adam_seconds_all", adam_s},
                        {"copy_seconds_all", copy_s}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench adam: %zu params (%s), %s, on %s; median of %lld steps\n", n,
              format_bytes(bytes_per_step).c_str(), dtype_name_s.c_str(), dev.name().c_str(),
              static_cast<long long>(a.steps));
  std::printf("  %-12s %12s %14s %12s\n", "kernel", "ms/step", "params/s", "bandwidth");
  std::printf("  %-12s %12.3f %13.1fM %12s\n", "adam", seconds_per_step * 1e3,
              static_cast<double>(n) / seconds_per_step / 1e6, format_rate(bytes_per_s).c_str());
  std::printf("  %-12s %12.3f %14s %12s\n", "device copy", median(copy_s) * 1e3, "",
              format_rate(copy_bytes_per_s).c_str());
  std::printf("  roofline_ratio %.3f (adam bandwidth / the device's copy bandwidth)\n", ratio);
}

void run(const Args& a) {
  const size_t n = bytes_flag("--params", a.params);
  if (n == 0) throw CliError("--params must be at least 1", 2);
  if (a.threads < 0) throw CliError("--threads must be >= 0 (0 = all cores)", 2);
  if (a.steps < 1) throw CliError("--steps must be at least 1", 2);
  if (a.warmup < 0) throw CliError("--warmup must be >= 0", 2);
  const auto precision = parse_dtype(a.precision);
  if (!precision)
    throw CliError("--precision must be fp32, bf16 or fp16, not '" + a.precision + "'", 2);
  const auto isa_arg = k::parse_isa(a.isa);
  if (!isa_arg)
    throw CliError("--isa must be auto, scalar, avx2 or avx512, not '" + a.isa + "'", 2);
  const k::Isa isa = *isa_arg == k::Isa::kAuto ? k::best_isa() : *isa_arg;
  if (!k::isa_supported(isa)) {
    throw CliError("--isa " + a.isa + ": this CPU has no such path (it has: " +
                       k::describe(k::cpu_features()) + ")",
                   2);
  }
  const auto device = parse_device_kind(a.device);
  if (!device || *device == DeviceKind::kAuto) {
    throw CliError("--device must be cpu, cpu-strict or cuda, not '" + a.device + "'", 2);
  }
  if (*device != DeviceKind::kCpu) {
    if (a.isa != "auto" || a.threads != 0) {
      throw CliError("--isa and --threads choose the CPU path; --device " + a.device +
                         " runs the device backend's own kernels",
                     2);
    }
    run_on_device(a, *device, n, *precision);
    return;
  }
  const int threads = k::resolve_threads(static_cast<int>(a.threads));

  // fp32: fp32 gradients, no copy. bf16 / fp16: gradients in that type, fp32 master + moments,
  // and the updated parameters written to a working copy in that type (fp16 with loss scaling).
  const DType dtype = *precision;
  const bool mixed = dtype != DType::kF32;
  HostArray param(n * 4), m(n * 4), v(n * 4), grad(n * dtype_size(dtype));
  HostArray copy(mixed ? n * dtype_size(dtype) : 0);
  const k::AdamTensors t{.param = static_cast<float*>(param.data()),
                         .m = static_cast<float*>(m.data()),
                         .v = static_cast<float*>(v.data()),
                         .grad = grad.data(),
                         .grad_dtype = dtype,
                         .param_copy = mixed ? copy.data() : nullptr,
                         .copy_dtype = dtype,
                         .n = n};
  const float loss_scale = dtype == DType::kF16 ? kFp16LossScale : 1.0f;
  fill(t, threads, loss_scale);

  const k::AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f};
  int64_t step = 0;
  auto adam = [&] {
    k::adam_step(cfg, {.step = ++step, .grad_scale = 1.0f / loss_scale}, t, threads, isa);
  };
  // The yardstick always streams with the widest SIMD path, whatever path Adam is asked to use.
  auto roofline = [&] { k::adam_traffic_roofline(t, threads, k::Isa::kAuto); };

  for (int64_t i = 0; i < a.warmup; ++i) {
    adam();
    roofline();
  }
  // Interleaved in ABBA order, so that a neighbour's load on a shared machine, or a drift of
  // the clock, weighs on both series alike.
  std::vector<double> adam_s, roof_s;
  for (int64_t i = 0; i < a.steps; ++i) {
    if (i % 2 == 0) {
      adam_s.push_back(seconds_of(adam));
      roof_s.push_back(seconds_of(roofline));
    } else {
      roof_s.push_back(seconds_of(roofline));
      adam_s.push_back(seconds_of(adam));
    }
  }

  const double bytes_per_step = static_cast<double>(k::adam_step_bytes(t));
  const double seconds_per_step = median(adam_s);
  const double roofline_seconds = median(roof_s);
  const double bytes_per_s = bytes_per_step / seconds_per_step;
  const double roofline_bytes_per_s = bytes_per_step / roofline_seconds;
  const double ratio = bytes_per_s / roofline_bytes_per_s;
  const std::string dtype_name_s(dtype_name(dtype));

  if (a.json) {
    nlohmann::json j = {{"params", n},
                        {"threads", threads},
                        {"precision", dtype_name_s},
                        {"isa", std::string(k::isa_name(isa))},
                        {"steps", a.steps},
                        {"warmup", a.warmup},
                        {"bytes_per_param", bytes_per_step / static_cast<double>(n)},
                        {"seconds_per_step", seconds_per_step},
                        {"params_per_s", static_cast<double>(n) / seconds_per_step},
                        {"bytes_per_s", bytes_per_s},
                        {"roofline_seconds", roofline_seconds},
                        {"roofline_bytes_per_s", roofline_bytes_per_s},
                        {"roofline_ratio", ratio},
                        {"adam_seconds_all", adam_s},
                        {"roofline_seconds_all", roof_s}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("zinf bench adam: %zu params (%s), %s, %d thread%s, %s path; median of %lld steps\n",
              n, format_bytes(bytes_per_step).c_str(), dtype_name_s.c_str(), threads,
              threads == 1 ? "" : "s", std::string(k::isa_name(isa)).c_str(),
              static_cast<long long>(a.steps));
  std::printf("  %-10s %12s %14s %12s\n", "kernel", "ms/step", "params/s", "bandwidth");
  std::printf("  %-10s %12.3f %13.1fM %12s\n", "adam", seconds_per_step * 1e3,
              static_cast<double>(n) / seconds_per_step / 1e6, format_rate(bytes_per_s).c_str());
  std::printf("  %-10s %12.3f %14s %12s\n", "roofline", roofline_seconds * 1e3, "",
              format_rate(roofline_bytes_per_s).c_str());
  std::printf("  roofline_ratio %.3f (adam bandwidth / streaming bandwidth of the same traffic)\n",
              ratio);
}

void setup(CLI::App& sub) {
  auto args = std::make_shared<Args>();
  sub.add_option("--params", args->params, "Parameters per step (K/M/G: binary multiples)")
      ->capture_default_str();
  sub.add_option("--threads", args->threads, "Threads (0 = all cores)")->capture_default_str();
  sub.add_option("--precision", args->precision,
                 "fp32 | bf16 | fp16 (gradients and working copy; master and moments are fp32)")
      ->capture_default_str();
  sub.add_option("--steps", args->steps, "Timed steps (the median is reported)")
      ->capture_default_str();
  sub.add_option("--warmup", args->warmup, "Untimed steps first")->capture_default_str();
  sub.add_option("--isa", args->isa, "auto | scalar | avx2 | avx512")->capture_default_str();
  sub.add_option("--device", args->device,
                 "cpu (the CPU Adam kernels, against their streaming roofline) | cuda | cpu-strict "
                 "(the step through that device backend, against its device copy)")
      ->capture_default_str();
  sub.add_flag("--json", args->json, "Print one JSON object");
  sub.callback([args] { run(*args); });
}

const Registration kReg{"bench", "adam",
                        "Adam step vs the memory bandwidth of the same traffic (roofline), on the "
                        "CPU or a device",
                        &setup};

}  // namespace
}  // namespace zinf::cli
