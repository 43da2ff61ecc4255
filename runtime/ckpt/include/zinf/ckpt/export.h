// A checkpoint's weights as one safetensors file (https://github.com/huggingface/safetensors:
// 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
// data_offsets, then the raw data), streamed parameter by parameter through a bounded buffer:
// a model larger than RAM exports. Tensors are named "<unit>.<parameter>" in unit order; the
// values are the fp32 master (mixed precision) or the fp32 parameters, written as F32 or
// converted to BF16 (round to nearest even). The bytes equal those of `zinf train --export`
// for the same state.
#pragma once

#include <string>

#include "zinf/ckpt/manifest.h"
#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf::ckpt {

// Every file is verified first (verify_all). The output is written under `<out>.partial`
// (created fresh, never through a symlink), fsync'd and renamed over `out`.
Status export_safetensors(const std::string& dir, const Manifest& m, const std::string& out,
                          DType dtype = DType::kF32);

}  // namespace zinf::ckpt
