// safetensors files of fp32 tensors: an 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and byte range, then the raw data (huggingface/safetensors).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::gpt {

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;

  bool operator==(const NamedTensor&) const = default;
};

// Writes `tensors` (in this order) as a safetensors file, through `<path>.partial` renamed over
// `path`. Refused before anything is written: a name that is empty, not UTF-8, repeated or
// "__metadata__", and a shape whose element count is not the data's.
Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors);

// The tensors of a safetensors file held in `bytes`, in the order of their data. Only F32 is
// read (what write_safetensors writes). Anything else is a kCorrupt or kInvalidArgument error,
// never a crash: a header length past the end, a header that is not a JSON object, a field of the
// wrong type, a byte range that is not the shape's size, ranges that overlap, leave a hole or do
// not end where the file does.
Result<std::vector<NamedTensor>> parse_safetensors(std::span<const uint8_t> bytes);

}  // namespace zinf::gpt
