// safetensors files: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw data (huggingface/safetensors). zinf writes F32
// (write_safetensors, and BF16 from `zinf checkpoint export`); it reads F32 whole
// (parse_safetensors) and F32, BF16 and F16 tensor by tensor from a mapped file (SafetensorsFile).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/dtype.h"
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

// One tensor of a safetensors file, as its header describes it.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t data_begin = 0, data_end = 0;  // its bytes in the data section
};

// A safetensors file read tensor by tensor, never loaded whole: open() reads and checks the
// header as parse_safetensors does (ranges that tile the data section to the file's end) and maps
// the file read-only; value() reads one element from the mapping, so only the pages touched are
// read, and they are the page cache's (file-backed, reclaimable), not the process's own memory.
// F32, BF16 and F16 are read (widened to fp32 exactly); another dtype is a kInvalidArgument error
// naming the tensor. Errors name the file.
//
// Move-only owner of the mapping. value() is const and may be called from several threads. The
// file must not be truncated while it is open (a mapped read past its new end raises SIGBUS).
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path);
  SafetensorsFile() = default;
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in the order of their data
  const TensorInfo* find(std::string_view name) const;
  // Element `i` (< t.numel) of tensor `t` (one of tensors()), as fp32.
  float value(const TensorInfo& t, uint64_t i) const;

 private:
  void unmap();
  std::string path_;
  std::vector<TensorInfo> tensors_;
  void* map_ = nullptr;
  uint64_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;  // the data section, inside the mapping
};

}  // namespace zinf::gpt
