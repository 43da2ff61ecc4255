#include "zinf/gpt/params.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "random.h"

namespace zinf::gpt {

UnitKind unit_kind(const GptConfig& cfg, int unit) {
  ZINF_CHECK(unit >= 0 && unit < cfg.num_units(), "unit {} of {}", unit, cfg.num_units());
  if (unit == 0) return UnitKind::kEmbedding;
  if (unit == cfg.final_norm_unit()) return UnitKind::kFinalNorm;
  return UnitKind::kBlock;
}

std::string unit_name(const GptConfig& cfg, int unit) {
  switch (unit_kind(cfg, unit)) {
    case UnitKind::kEmbedding:
      return "embedding";
    case UnitKind::kFinalNorm:
      return "final_norm";
    case UnitKind::kBlock:
      break;
  }
  return fmt::format("block.{}", unit - 1);
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamSpec> unit_params(UnitKind kind, const GptConfig& cfg) {
  constexpr float kStd = 0.02f;
  const int64_t d = cfg.dim;
  auto matrix = [](std::string name, int64_t rows, int64_t cols, float std) {
    return ParamSpec{.name = std::move(name),
                     .shape = {rows, cols},
                     .weight_decay = true,
                     .init = Init::kNormal,
                     .init_std = std};
  };
  auto vec = [](std::string name, int64_t n, Init init) {
    return ParamSpec{.name = std::move(name), .shape = {n}, .weight_decay = false, .init = init};
  };
  switch (kind) {
    case UnitKind::kEmbedding:
      return {matrix("wte", cfg.vocab, d, kStd), matrix("wpe", cfg.seq, d, kStd)};
    case UnitKind::kFinalNorm:
      return {vec("lnf_w", d, Init::kOnes), vec("lnf_b", d, Init::kZeros)};
    case UnitKind::kBlock:
      break;
  }
  // GPT-2: the projections that write into the residual stream start smaller, by 1/sqrt(2 L)
  // (two of them per block), so the stream's variance does not grow with depth.
  const float residual_std = kStd / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  // The order is block_view()'s.
  return {
      vec("ln1_w", d, Init::kOnes),
      vec("ln1_b", d, Init::kZeros),
      matrix("qkv_w", 3 * d, d, kStd),
      vec("qkv_b", 3 * d, Init::kZeros),
      matrix("attn_proj_w", d, d, residual_std),
      vec("attn_proj_b", d, Init::kZeros),
      vec("ln2_w", d, Init::kOnes),
      vec("ln2_b", d, Init::kZeros),
      matrix("fc_w", 4 * d, d, kStd),
      vec("fc_b", 4 * d, Init::kZeros),
      matrix("mlp_proj_w", d, 4 * d, residual_std),
      vec("mlp_proj_b", d, Init::kZeros),
  };
}

int64_t unit_numel(UnitKind kind, const GptConfig& cfg) {
  const int64_t d = cfg.dim;
  switch (kind) {
    case UnitKind::kEmbedding:
      return (int64_t{cfg.vocab} + cfg.seq) * d;
    case UnitKind::kFinalNorm:
      return 2 * d;
    case UnitKind::kBlock:
      break;
  }
  return 12 * d * d + 13 * d;
}

float init_value(const ParamSpec& spec, uint64_t element_index, uint64_t seed, uint64_t unit_salt) {
  switch (spec.init) {
    case Init::kOnes:
      return 1.0f;
    case Init::kZeros:
      return 0.0f;
    case Init::kNormal:
      break;
  }
  const uint64_t h =
      detail::hash_words({seed, unit_salt, detail::hash_name(spec.name), element_index});
  return static_cast<float>(spec.init_std * detail::normal_from_hash(h));
}

UnitView::UnitView(UnitKind kind, const GptConfig& cfg, float* base) {
  for (ParamSpec& spec : unit_params(kind, cfg)) {
    const int64_t n = spec.numel();
    tensors_.push_back({.spec = std::move(spec), .offset = numel_, .data = base + numel_});
    numel_ += n;
  }
}

Result<UnitView::Tensor> UnitView::find(std::string_view name) const {
  std::vector<std::string_view> names;
  for (const Tensor& t : tensors_) {
    if (t.spec.name == name) return t;
    names.push_back(t.spec.name);
  }
  return make_error(ErrorCode::kNotFound, "no tensor '{}' in this unit (it has {})", name,
                    fmt::join(names, ", "));
}

}  // namespace zinf::gpt
