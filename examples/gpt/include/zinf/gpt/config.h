// The shape of the GPT example: a decoder-only transformer over a byte-level vocabulary.
//
//   tokens [B,T] -> embedding (wte[token] + wpe[position]) -> L pre-LN blocks -> final layer norm
//   -> logits = h @ wte^T (the head is tied to the token embedding) -> cross-entropy
//
// The model is split into Engine units, numbered in the order the forward pass uses them:
//   unit 0          the embedding (wte, wpe; the tied head reads and accumulates into it too)
//   units 1..L      the transformer blocks
//   unit L+1        the final layer norm
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf::gpt {

struct GptConfig {
  int vocab = 256;  // byte-level: every byte is a token
  int seq = 0;      // the longest sequence (number of learned positions)
  int dim = 0;      // model width D
  int heads = 0;    // attention heads; head_dim = dim / heads
  int layers = 0;   // transformer blocks L

  int head_dim() const { return dim / heads; }
  int num_units() const { return layers + 2; }
  int final_norm_unit() const { return layers + 1; }
};

// Positive sizes, dim divisible by heads, and sizes small enough that every index fits the
// 32-bit BLAS interface. Errors name the offending field and value.
Status validate(const GptConfig& cfg);

// The named shapes: "tiny" (tests), "small" (the default run), "gpt2-124m" (GPT-2 small's shape;
// with a 256-byte vocabulary it has 86 M parameters, not 124 M), "1b" and "2b" (the scale demo).
// An unknown name is kInvalidArgument listing the valid ones.
Result<GptConfig> preset(std::string_view name);
std::span<const std::string_view> preset_names();

// Parameters of the whole model (sum of the units' unpadded sizes).
int64_t parameter_count(const GptConfig& cfg);

// "L=4 D=128 H=4 T=128 V=256 (0.86 M parameters)".
std::string describe(const GptConfig& cfg);

}  // namespace zinf::gpt
