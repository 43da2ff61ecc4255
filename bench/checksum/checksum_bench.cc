// The swap checksums (XXH3-64 of 1 MiB blocks) under Google Benchmark, on both builds of the hash
// this CPU runs: libxxhash's (the x86-64 baseline) and zinf's AVX2 one (checksum64() takes it
// where the CPU has AVX2). `InCache` hashes one block again and again (compute-bound: a block
// hashed right after it was written); `FromMemory` walks 256 MiB (bandwidth-bound: a block just
// read from the disk).
//   checksum_bench                     (bytes_per_second: bytes hashed per second)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "zinf/io/checksum.h"

namespace {

namespace d = zinf::io::detail;
using HashFn = uint64_t (*)(const void*, size_t);

constexpr size_t kBlock = size_t{1} << 20;

void run(benchmark::State& state, HashFn fn, size_t span) {
  if (fn == &d::checksum64_avx2 && !d::checksum64_has_avx2()) {
    state.SkipWithError("this CPU has no AVX2");
    return;
  }
  std::vector<unsigned char> data(span);
  for (size_t i = 0; i < span; ++i) data[i] = static_cast<unsigned char>(i * 131 + (i >> 12));
  size_t pos = 0;
  uint64_t sum = 0;
  for (auto _ : state) {
    sum += fn(data.data() + pos, kBlock);
    pos = (pos + kBlock) % span;
  }
  benchmark::DoNotOptimize(sum);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBlock));
}

void InCache(benchmark::State& state, HashFn fn) { run(state, fn, kBlock); }
void FromMemory(benchmark::State& state, HashFn fn) { run(state, fn, size_t{256} << 20); }

BENCHMARK_CAPTURE(InCache, portable, &d::checksum64_portable);
BENCHMARK_CAPTURE(InCache, avx2, &d::checksum64_avx2);
BENCHMARK_CAPTURE(FromMemory, portable, &d::checksum64_portable);
BENCHMARK_CAPTURE(FromMemory, avx2, &d::checksum64_avx2);

}  // namespace

BENCHMARK_MAIN();
