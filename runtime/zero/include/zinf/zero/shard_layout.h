// Flat units and shard layouts: one flat buffer per unit, every view an offset into it.
//
// A unit (typically one transformer block) is a list of named parameters. Its parameters live in
// one flat buffer, in declaration order, each at an offset (a view); the buffer is padded at the
// end so that it splits into `world` equal shards of whole 4 KiB blocks in the working dtype
// (and so of whole blocks in fp32 too). Rank r owns elements [r * shard_numel, (r+1) *
// shard_numel). One unit = one all-gather, one NVMe extent per state, one reduce-scatter.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf::zero {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool weight_decay = true;  // AdamW decay applies (false for biases and norms, typically)
};

struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
};

struct ParamView {
  std::string name;
  uint64_t offset = 0;  // elements from the start of the unit's flat buffer
  uint64_t numel = 0;
  bool weight_decay = true;
};

struct ShardLayout {
  int world = 1;
  uint64_t numel = 0;         // sum of the parameters' elements
  uint64_t numel_padded = 0;  // numel rounded up to world * block_numel
  uint64_t shard_numel = 0;   // numel_padded / world
  uint64_t block_numel = 0;   // elements per 4 KiB block in the working dtype
  std::vector<ParamView> params;

  uint64_t shard_begin(int rank) const { return static_cast<uint64_t>(rank) * shard_numel; }
  uint64_t shard_end(int rank) const { return shard_begin(rank) + shard_numel; }
};

// Fails (kInvalidArgument, naming the unit and parameter) on empty units, empty or negative
// shapes, duplicate names, or a world size below 1.
Result<ShardLayout> make_shard_layout(const UnitSpec& unit, int world, DType working_dtype);

// A contiguous range of a unit's flat buffer that lies within one parameter.
struct Segment {
  uint64_t begin = 0;  // flat element index
  uint64_t end = 0;
  bool weight_decay = true;
};
// Splits [begin, end) at parameter boundaries; padding after the last parameter becomes a
// segment with weight_decay = false (its elements stay zero under Adam).
std::vector<Segment> segments(const ShardLayout& layout, uint64_t begin, uint64_t end);

}  // namespace zinf::zero
