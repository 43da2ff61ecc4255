// CPU Adam kernels under Google Benchmark, on every SIMD path this CPU has: the Adam step and its
// traffic roofline per precision, in cache (compute-bound: how much headroom the math leaves) and
// from memory (bandwidth-bound), plus the driver's helpers (sum of squares, inf/NaN check, casts).
//   adam_bench --benchmark_filter='Adam.*fp32'   (bytes_per_second: memory traffic per second)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/kernels/cpu_adam.h"

namespace {

namespace k = zinf::kernels;
using zinf::DType;

// The arrays of one step: fp32 master, moments; gradients and working copy in `precision`.
struct Problem {
  std::vector<float> param, m, v;
  std::vector<uint8_t> grad, copy;
  k::AdamTensors tensors;

  Problem(size_t n, DType precision)
      : param(n), m(n, 0.0f), v(n, 0.0f), grad(n * zinf::dtype_size(precision)) {
    for (size_t i = 0; i < n; ++i) param[i] = 0.01f * static_cast<float>(i % 97) - 0.5f;
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = 1e-4f * static_cast<float>(i % 89) - 4e-3f;
    k::cast(g.data(), DType::kF32, grad.data(), precision, n);
    const bool mixed = precision != DType::kF32;
    if (mixed) copy.resize(n * zinf::dtype_size(precision));
    tensors = {.param = param.data(),
               .m = m.data(),
               .v = v.data(),
               .grad = grad.data(),
               .grad_dtype = precision,
               .param_copy = mixed ? copy.data() : nullptr,
               .copy_dtype = precision,
               .n = n};
  }
};

void set_rates(benchmark::State& state, size_t elems, size_t bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["elems_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * elems), benchmark::Counter::kIsRate);
}

void adam_step(benchmark::State& state, DType precision, k::Isa isa) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  Problem p(n, precision);
  const k::AdamConfig cfg{.weight_decay = 0.01f};
  int64_t step = 0;
  for (auto _ : state) {
    k::adam_step(cfg, {.step = ++step}, p.tensors, threads, isa);
  }
  set_rates(state, n, k::adam_step_bytes(p.tensors));
}

void traffic_roofline(benchmark::State& state, DType precision, k::Isa isa) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  Problem p(n, precision);
  for (auto _ : state) k::adam_traffic_roofline(p.tensors, threads, isa);
  set_rates(state, n, k::adam_step_bytes(p.tensors));
}

void sum_squares(benchmark::State& state, DType dtype, k::Isa isa) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  Problem p(n, dtype);
  for (auto _ : state) {
    benchmark::DoNotOptimize(k::grad_sum_squares(p.grad.data(), dtype, n, 1.0f, threads, isa));
  }
  set_rates(state, n, n * zinf::dtype_size(dtype));
}

void has_nonfinite(benchmark::State& state, DType dtype, k::Isa isa) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  Problem p(n, dtype);
  for (auto _ : state) {
    benchmark::DoNotOptimize(k::grad_has_nonfinite(p.grad.data(), dtype, n, threads, isa));
  }
  set_rates(state, n, n * zinf::dtype_size(dtype));
}

void cast_from_f32(benchmark::State& state, DType dtype, k::Isa isa) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  std::vector<float> src(n, 1.0f / 3.0f);
  std::vector<uint16_t> dst(n);
  for (auto _ : state) k::cast(src.data(), DType::kF32, dst.data(), dtype, n, threads, isa);
  set_rates(state, n, n * (4 + 2));
}

void register_all() {
  constexpr int64_t kInCache = 16 * 1024;          // 448 KiB of fp32 Adam state: L2
  constexpr int64_t kInMemory = 32 * 1024 * 1024;  // 896 MiB: DRAM
  const std::vector<std::vector<int64_t>> sizes = {{kInCache, 1}, {kInMemory, 1}, {kInMemory, 2}};
  for (k::Isa isa : {k::Isa::kScalar, k::Isa::kAvx2, k::Isa::kAvx512}) {
    if (!k::isa_supported(isa)) continue;
    const std::string in(k::isa_name(isa));
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      const std::string dn(zinf::dtype_name(d));
      auto* a =
          benchmark::RegisterBenchmark(("AdamStep/" + dn + "/" + in).c_str(), adam_step, d, isa);
      auto* r = benchmark::RegisterBenchmark(("AdamTrafficRoofline/" + dn + "/" + in).c_str(),
                                             traffic_roofline, d, isa);
      auto* s = benchmark::RegisterBenchmark(("GradSumSquares/" + dn + "/" + in).c_str(),
                                             sum_squares, d, isa);
      auto* h = benchmark::RegisterBenchmark(("GradHasNonfinite/" + dn + "/" + in).c_str(),
                                             has_nonfinite, d, isa);
      for (auto* b : {a, r, s, h}) {
        b->ArgNames({"n", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
        for (const auto& args : sizes) b->Args(args);
      }
      if (d != DType::kF32) {
        auto* c = benchmark::RegisterBenchmark(("CastF32To/" + dn + "/" + in).c_str(),
                                               cast_from_f32, d, isa);
        c->ArgNames({"n", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
        for (const auto& args : sizes) c->Args(args);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
