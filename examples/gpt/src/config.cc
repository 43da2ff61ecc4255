#include "zinf/gpt/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>

#include "zinf/core/units.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

struct Preset {
  std::string_view name;
  GptConfig cfg;
};

// small: 0.83 M parameters and a context of 64 bytes; forward + backward of 16 x 64 tokens takes
// about 50 ms on the two Zen 3 cores of the development machine, so a run of a few minutes sees a
// few million bytes. (A context of 128 learned more slowly per byte: the position embeddings see
// half as many samples each.)
constexpr std::array kPresets = {
    Preset{"tiny", {.vocab = 256, .seq = 16, .dim = 32, .heads = 4, .layers = 2}},
    Preset{"small", {.vocab = 256, .seq = 64, .dim = 128, .heads = 4, .layers = 4}},
    Preset{"gpt2-124m", {.vocab = 256, .seq = 1024, .dim = 768, .heads = 12, .layers = 12}},
    Preset{"1b", {.vocab = 256, .seq = 1024, .dim = 2048, .heads = 16, .layers = 20}},
    Preset{"2b", {.vocab = 256, .seq = 1024, .dim = 2560, .heads = 20, .layers = 26}},
};

constexpr std::array<std::string_view, kPresets.size()> kPresetNames = [] {
  std::array<std::string_view, kPresets.size()> names{};
  for (size_t i = 0; i < kPresets.size(); ++i) names[i] = kPresets[i].name;
  return names;
}();

Status check_range(std::string_view field, int value, int lo, int hi) {
  if (value < lo || value > hi) {
    return make_error(ErrorCode::kInvalidArgument, "GPT config: {} = {} is outside [{}, {}]", field,
                      value, lo, hi);
  }
  return Status::ok();
}

}  // namespace

Status validate(const GptConfig& cfg) {
  // The bounds keep every matrix dimension and leading dimension (at most 4 * dim, or B*T rows
  // checked at call time) inside the 32-bit BLAS interface.
  ZINF_RETURN_IF_ERROR(check_range("vocab", cfg.vocab, 1, 1 << 20));
  ZINF_RETURN_IF_ERROR(check_range("seq", cfg.seq, 1, 1 << 16));
  ZINF_RETURN_IF_ERROR(check_range("dim", cfg.dim, 1, 1 << 16));
  ZINF_RETURN_IF_ERROR(check_range("heads", cfg.heads, 1, cfg.dim));
  ZINF_RETURN_IF_ERROR(check_range("layers", cfg.layers, 1, 1 << 12));
  if (cfg.dim % cfg.heads != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GPT config: dim = {} is not a multiple of heads = {}", cfg.dim, cfg.heads);
  }
  return Status::ok();
}

std::span<const std::string_view> preset_names() { return kPresetNames; }

Result<GptConfig> preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (p.name == name) return p.cfg;
  }
  return make_error(ErrorCode::kInvalidArgument, "unknown GPT preset '{}' (valid: {})", name,
                    fmt::join(kPresetNames, ", "));
}

int64_t parameter_count(const GptConfig& cfg) {
  return unit_numel(UnitKind::kEmbedding, cfg) +
         int64_t{cfg.layers} * unit_numel(UnitKind::kBlock, cfg) +
         unit_numel(UnitKind::kFinalNorm, cfg);
}

std::string describe(const GptConfig& cfg) {
  const std::string count = format_count(static_cast<double>(parameter_count(cfg)));
  return fmt::format("L={} D={} H={} T={} V={} ({} parameters)", cfg.layers, cfg.dim, cfg.heads,
                     cfg.seq, cfg.vocab, count);
}

}  // namespace zinf::gpt
