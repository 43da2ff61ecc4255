// The host side of the reductions: reduce_element's arithmetic (reduce_math.h) in blocks, so the
// fp32 adds of one source run as one vectorisable loop. Each element still sees exactly
// acc = src0; acc = acc + src1; ...; acc = acc * scale (when scale != 1); one rounding.
#include <algorithm>

#include "zinf/comm/detail/op_header.h"
#include "zinf/comm/reduce_math.h"

namespace zinf::comm::detail {
namespace {

constexpr size_t kBlock = 2048;

template <DType kType>
void reduce_blocks(void* dst, const void* const* srcs, int nsrc, size_t count, float scale) {
  alignas(64) float acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    for (size_t i = 0; i < n; ++i) acc[i] = load_as_f32(srcs[0], base + i, kType);
    for (int j = 1; j < nsrc; ++j) {
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + load_as_f32(srcs[j], base + i, kType);
    }
    if (scale != 1.0f) {
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] * scale;
    }
    for (size_t i = 0; i < n; ++i) store_from_f32(dst, base + i, kType, acc[i]);
  }
}

}  // namespace

float reduce_scale(ReduceOp op, int world) {
  return op == ReduceOp::kAvg ? 1.0f / static_cast<float>(world) : 1.0f;
}

void reduce_rank_order(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                       float scale) {
  switch (dtype) {
    case DType::kF32:
      reduce_blocks<DType::kF32>(dst, srcs, nsrc, count, scale);
      break;
    case DType::kBF16:
      reduce_blocks<DType::kBF16>(dst, srcs, nsrc, count, scale);
      break;
    case DType::kF16:
      reduce_blocks<DType::kF16>(dst, srcs, nsrc, count, scale);
      break;
  }
}

}  // namespace zinf::comm::detail
