// Dispatch and threading of the CPU kernels: picks the instruction-set table, cuts the arrays into
// kCpuChunkElems chunks for oneTBB, finishes SIMD tails with the scalar table.
#include "zinf/kernels/cpu_adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

#include "kernel_table.h"
#include "zinf/core/status.h"

namespace zinf::kernels {
namespace {

using detail::AdamSpan;
using detail::CopyKind;
using detail::KernelTable;

static_assert(kCpuChunkElems % kSumSquaresBlockElems == 0, "blocks must not straddle chunks");
static_assert(kSumSquaresBlockElems % detail::kSumSquaresLanes == 0);

const KernelTable& table_for(Isa isa) {
  if (isa == Isa::kAuto) isa = best_isa();
  ZINF_CHECK(isa_supported(isa), "the {} kernels cannot run on this CPU ({})", isa_name(isa),
             describe(cpu_features()));
  switch (isa) {
    case Isa::kAvx512:
      return *detail::avx512_kernels();
    case Isa::kAvx2:
      return *detail::avx2_kernels();
    default:
      return detail::scalar_kernels();
  }
}

// One arena per requested thread count, created on first use and kept for the process (arenas
// are cheap to keep and costly to rebuild for every optimizer sub-group). Never destroyed: static
// destruction order against oneTBB's own shutdown is not worth the risk.
tbb::task_arena& arena_for(int threads) {
  static std::mutex mu;
  static auto* arenas = new std::map<int, tbb::task_arena*>;
  std::lock_guard lock(mu);
  tbb::task_arena*& arena = (*arenas)[threads];
  if (arena == nullptr) arena = new tbb::task_arena(threads);
  return *arena;
}

// Calls body(begin, end) on disjoint ranges covering [0, n). Every range boundary except n is a
// multiple of kCpuChunkElems, whatever the thread count. threads == 1, or a single chunk, runs on
// the calling thread without TBB.
template <class Body>
void for_each_range(size_t n, int threads, const Body& body) {
  threads = resolve_threads(threads);
  if (n == 0) return;
  const size_t chunks = (n + kCpuChunkElems - 1) / kCpuChunkElems;
  if (threads == 1 || chunks == 1) {
    body(size_t{0}, n);
    return;
  }
  arena_for(threads).execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks),
                      [&](const tbb::blocked_range<size_t>& r) {
                        body(r.begin() * kCpuChunkElems, std::min(n, r.end() * kCpuChunkElems));
                      });
  });
}

const char* advance(const void* p, size_t elems, DType dtype) {
  return static_cast<const char*>(p) + elems * dtype_size(dtype);
}
char* advance(void* p, size_t elems, DType dtype) {
  return static_cast<char*>(p) + elems * dtype_size(dtype);
}

CopyKind copy_kind(const AdamTensors& t) {
  if (t.param_copy == nullptr) return CopyKind::kNone;
  switch (t.copy_dtype) {
    case DType::kF32:
      return CopyKind::kF32;
    case DType::kBF16:
      return CopyKind::kBF16;
    case DType::kF16:
      break;
  }
  return CopyKind::kF16;
}

AdamSpan span_of(const AdamTensors& t, size_t begin, size_t end) {
  return AdamSpan{
      .param = t.param + begin,
      .m = t.m + begin,
      .v = t.v + begin,
      .grad = advance(t.grad, begin, t.grad_dtype),
      .copy = t.param_copy ? advance(t.param_copy, begin, t.copy_dtype) : nullptr,
      .n = end - begin,
  };
}

void check_tensors(const AdamTensors& t) {
  ZINF_CHECK(t.n == 0 || (t.param && t.m && t.v && t.grad), "adam: null array for n = {}", t.n);
}

// The 16 lanes of one block, added as the fixed tree lane[i] += lane[i + w], w = 8, 4, 2, 1.
double reduce_lanes(double* lanes) {
  for (size_t w = detail::kSumSquaresLanes / 2; w >= 1; w /= 2) {
    for (size_t i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  }
  return lanes[0];
}

}  // namespace

int resolve_threads(int threads) {
  ZINF_CHECK(threads >= 0, "threads must be >= 0 (0 = all), got {}", threads);
  const int available = tbb::info::default_concurrency();
  return threads == 0 ? available : std::min(threads, available);
}

AdamStats adam_step(const AdamConfig& cfg, const AdamStepArgs& args, const AdamTensors& t,
                    int threads, Isa isa) {
  check_tensors(t);
  ZINF_CHECK(!cfg.bias_correction || args.step >= 1, "adam: step is 1-based, got {}", args.step);
  const AdamCoeffs coeffs = adam_coeffs(cfg, args);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  const CopyKind copy = copy_kind(t);
  std::atomic<bool> nonfinite{false};
  for_each_range(t.n, threads, [&](size_t begin, size_t end) {
    const AdamSpan s = span_of(t, begin, end);
    bool bad = false;
    const size_t done = simd.adam(coeffs, s, t.grad_dtype, copy, &bad);
    if (done < s.n) scalar.adam(coeffs, span_of(t, begin + done, end), t.grad_dtype, copy, &bad);
    if (bad) nonfinite.store(true, std::memory_order_relaxed);
  });
  return AdamStats{.found_nonfinite_grad = nonfinite.load()};
}

size_t adam_step_bytes(const AdamTensors& t) {
  size_t per_elem = 3 * 2 * sizeof(float) + dtype_size(t.grad_dtype);
  if (t.param_copy != nullptr) per_elem += dtype_size(t.copy_dtype);
  return per_elem * t.n;
}

void adam_traffic_roofline(const AdamTensors& t, int threads, Isa isa) {
  check_tensors(t);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  const CopyKind copy = copy_kind(t);
  // A zero the compiler cannot see through: the stores must depend on the loads.
  static volatile float zero_source = 0.0f;
  const float zero = zero_source;
  for_each_range(t.n, threads, [&](size_t begin, size_t end) {
    const size_t done = simd.traffic(span_of(t, begin, end), t.grad_dtype, copy, zero);
    if (begin + done < end) {
      scalar.traffic(span_of(t, begin + done, end), t.grad_dtype, copy, zero);
    }
  });
}

size_t sum_squares_block_count(size_t n) {
  return (n + kSumSquaresBlockElems - 1) / kSumSquaresBlockElems;
}

void grad_sum_squares_blocks(const void* grad, DType dtype, size_t n, float scale,
                             double* block_sums, int threads, Isa isa) {
  ZINF_CHECK(n == 0 || (grad && block_sums), "grad_sum_squares: null array for n = {}", n);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  const double scale_d = scale;
  for_each_range(n, threads, [&](size_t begin, size_t end) {
    for (size_t b = begin; b < end; b += kSumSquaresBlockElems) {
      const size_t len = std::min(kSumSquaresBlockElems, end - b);
      const char* x = advance(grad, b, dtype);
      double lanes[detail::kSumSquaresLanes] = {};
      const size_t done = simd.sum_squares(x, dtype, len, scale_d, lanes);
      if (done < len)
        scalar.sum_squares(advance(x, done, dtype), dtype, len - done, scale_d, lanes);
      block_sums[b / kSumSquaresBlockElems] = reduce_lanes(lanes);
    }
  });
}

double grad_sum_squares(const void* grad, DType dtype, size_t n, float scale, int threads,
                        Isa isa) {
  const size_t blocks = sum_squares_block_count(n);
  double small[64];
  std::vector<double> large;
  double* sums = small;
  if (blocks > std::size(small)) {
    large.resize(blocks);
    sums = large.data();
  }
  grad_sum_squares_blocks(grad, dtype, n, scale, sums, threads, isa);
  double total = 0.0;
  for (size_t b = 0; b < blocks; ++b) total += sums[b];
  return total;
}

bool grad_has_nonfinite(const void* grad, DType dtype, size_t n, int threads, Isa isa) {
  ZINF_CHECK(n == 0 || grad, "grad_has_nonfinite: null array for n = {}", n);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  std::atomic<bool> found{false};
  for_each_range(n, threads, [&](size_t begin, size_t end) {
    if (found.load(std::memory_order_relaxed)) return;  // the answer is known
    bool bad = false;
    const char* x = advance(grad, begin, dtype);
    const size_t done = simd.has_nonfinite(x, dtype, end - begin, &bad);
    if (!bad && begin + done < end) {
      scalar.has_nonfinite(advance(x, done, dtype), dtype, end - begin - done, &bad);
    }
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

void scale_inplace(void* data, DType dtype, size_t n, float scale, int threads, Isa isa) {
  ZINF_CHECK(n == 0 || data, "scale_inplace: null array for n = {}", n);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  for_each_range(n, threads, [&](size_t begin, size_t end) {
    char* x = advance(data, begin, dtype);
    const size_t done = simd.scale(x, dtype, end - begin, scale);
    if (begin + done < end) scalar.scale(advance(x, done, dtype), dtype, end - begin - done, scale);
  });
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n, int threads,
          Isa isa) {
  ZINF_CHECK(n == 0 || (src && dst), "cast: null array for n = {}", n);
  const KernelTable& simd = table_for(isa);
  const KernelTable& scalar = detail::scalar_kernels();
  for_each_range(n, threads, [&](size_t begin, size_t end) {
    const char* s = advance(src, begin, src_dtype);
    char* d = advance(dst, begin, dst_dtype);
    if (src_dtype == dst_dtype) {  // a copy: no round trip through fp32 (it would quiet NaNs)
      std::memcpy(d, s, (end - begin) * dtype_size(src_dtype));
      return;
    }
    const size_t done = simd.cast(s, src_dtype, d, dst_dtype, end - begin);
    if (begin + done < end) {
      scalar.cast(advance(s, done, src_dtype), src_dtype, advance(d, done, dst_dtype), dst_dtype,
                  end - begin - done);
    }
  });
}

namespace {

// One loop per source type so that GCC vectorises each (the conversions are branch-free).
template <typename Load>
void accumulate_range(float* acc, size_t n, bool overwrite, Load load) {
  if (overwrite) {
    for (size_t i = 0; i < n; ++i) acc[i] = 0.0f + load(i);
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] += load(i);
  }
}

}  // namespace

void accumulate(float* acc, const void* src, DType src_dtype, size_t n, bool overwrite,
                int threads) {
  ZINF_CHECK(n == 0 || (acc && src), "accumulate: null array for n = {}", n);
  for_each_range(n, threads, [&](size_t begin, size_t end) {
    float* a = acc + begin;
    const size_t len = end - begin;
    switch (src_dtype) {
      case DType::kF32: {
        const float* x = static_cast<const float*>(src) + begin;
        accumulate_range(a, len, overwrite, [x](size_t i) { return x[i]; });
        break;
      }
      case DType::kBF16: {
        const uint16_t* x = static_cast<const uint16_t*>(src) + begin;
        accumulate_range(a, len, overwrite, [x](size_t i) { return bf16_to_f32(x[i]); });
        break;
      }
      case DType::kF16: {
        const uint16_t* x = static_cast<const uint16_t*>(src) + begin;
        accumulate_range(a, len, overwrite, [x](size_t i) { return f16_to_f32(x[i]); });
        break;
      }
    }
  });
}

}  // namespace zinf::kernels
