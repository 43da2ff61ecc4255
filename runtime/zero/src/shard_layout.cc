#include "zinf/zero/shard_layout.h"

#include <algorithm>
#include <set>

namespace zinf::zero {

Result<ShardLayout> make_shard_layout(const UnitSpec& unit, int world, DType working_dtype) {
  if (world < 1) {
    return make_error(ErrorCode::kInvalidArgument, "unit {}: world size must be at least 1, got {}",
                      unit.name, world);
  }
  if (unit.params.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "unit {} has no parameters", unit.name);
  }
  ShardLayout l;
  l.world = world;
  l.block_numel = 4096 / dtype_size(working_dtype);
  std::set<std::string> names;
  for (const ParamSpec& p : unit.params) {
    if (!names.insert(p.name).second) {
      return make_error(ErrorCode::kInvalidArgument, "unit {}: parameter {} is declared twice",
                        unit.name, p.name);
    }
    if (p.shape.empty()) {
      return make_error(ErrorCode::kInvalidArgument, "unit {}: parameter {} has no shape",
                        unit.name, p.name);
    }
    uint64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d <= 0) {
        return make_error(ErrorCode::kInvalidArgument,
                          "unit {}: parameter {} has a dimension of {} (must be positive)",
                          unit.name, p.name, d);
      }
      numel *= static_cast<uint64_t>(d);
    }
    l.params.push_back(
        {.name = p.name, .offset = l.numel, .numel = numel, .weight_decay = p.weight_decay});
    l.numel += numel;
  }
  uint64_t quantum = l.block_numel * static_cast<uint64_t>(world);
  l.numel_padded = (l.numel + quantum - 1) / quantum * quantum;
  l.shard_numel = l.numel_padded / static_cast<uint64_t>(world);
  return l;
}

std::vector<Segment> segments(const ShardLayout& layout, uint64_t begin, uint64_t end) {
  std::vector<Segment> out;
  for (const ParamView& p : layout.params) {
    uint64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
    if (lo < hi) out.push_back({lo, hi, p.weight_decay});
  }
  uint64_t pad_lo = std::max(begin, layout.numel);
  if (pad_lo < end) out.push_back({pad_lo, end, false});
  return out;
}

}  // namespace zinf::zero
