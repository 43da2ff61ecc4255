// Presets, validation, the unit layout and initialisation.
#include "zinf/gpt/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

TEST(GptConfig, PresetsAreValidWithTheDocumentedSizes) {
  for (std::string_view name : preset_names()) {
    auto cfg = preset(name);
    ASSERT_TRUE(cfg.is_ok()) << name;
    EXPECT_TRUE(validate(*cfg).is_ok()) << name;
  }
  EXPECT_EQ(parameter_count(*preset("tiny")), 34'176);
  EXPECT_EQ(parameter_count(*preset("gpt2-124m")), 86'039'040);
  const int64_t one_b = parameter_count(*preset("1b"));
  const int64_t two_b = parameter_count(*preset("2b"));
  EXPECT_GT(one_b, 950'000'000);
  EXPECT_LT(one_b, 1'100'000'000);
  EXPECT_GT(two_b, 1'900'000'000);
  EXPECT_LT(two_b, 2'200'000'000);
  EXPECT_NE(describe(*preset("tiny")).find("34.2 K"), std::string::npos);
}

TEST(GptConfig, UnknownPresetListsTheValidNames) {
  auto cfg = preset("huge");
  ASSERT_FALSE(cfg.is_ok());
  EXPECT_EQ(cfg.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(cfg.status().message().find("'huge'"), std::string::npos);
  EXPECT_NE(cfg.status().message().find("tiny, small, gpt2-124m, 1b, 2b"), std::string::npos);
}

TEST(GptConfig, ValidationNamesTheField) {
  GptConfig cfg{.vocab = 256, .seq = 16, .dim = 30, .heads = 4, .layers = 2};
  Status s = validate(cfg);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dim = 30 is not a multiple of heads = 4"), std::string::npos);
  cfg.dim = 32;
  EXPECT_TRUE(validate(cfg).is_ok());
  cfg.layers = 0;
  EXPECT_NE(validate(cfg).message().find("layers = 0"), std::string::npos);
  cfg.layers = 2;
  cfg.seq = -1;
  EXPECT_NE(validate(cfg).message().find("seq = -1"), std::string::npos);
  cfg.seq = 16;
  cfg.heads = 64;
  EXPECT_NE(validate(cfg).message().find("heads = 64"), std::string::npos);
}

TEST(GptParams, UnitsAreNumberedEmbeddingBlocksFinalNorm) {
  const GptConfig cfg = *preset("tiny");
  EXPECT_EQ(cfg.num_units(), cfg.layers + 2);
  EXPECT_EQ(unit_kind(cfg, 0), UnitKind::kEmbedding);
  EXPECT_EQ(unit_kind(cfg, 1), UnitKind::kBlock);
  EXPECT_EQ(unit_kind(cfg, cfg.layers), UnitKind::kBlock);
  EXPECT_EQ(unit_kind(cfg, cfg.layers + 1), UnitKind::kFinalNorm);
  EXPECT_EQ(unit_name(cfg, 2), "block.1");
  EXPECT_EQ(unit_name(cfg, cfg.layers + 1), "final_norm");
}

// The typed views (used by the kernels) agree with unit_params() (used by the Engine).
TEST(GptParams, TypedViewsMatchTheListedLayout) {
  const GptConfig cfg{.vocab = 256, .seq = 24, .dim = 48, .heads = 3, .layers = 5};
  for (UnitKind kind : {UnitKind::kEmbedding, UnitKind::kBlock, UnitKind::kFinalNorm}) {
    std::vector<float> buf(static_cast<size_t>(unit_numel(kind, cfg)));
    UnitView view(kind, cfg, buf.data());
    EXPECT_EQ(view.numel(), unit_numel(kind, cfg));
    std::vector<float*> typed;
    if (kind == UnitKind::kEmbedding) {
      auto v = embedding_view(cfg, buf.data());
      typed = {v.wte, v.wpe};
    } else if (kind == UnitKind::kFinalNorm) {
      auto v = final_norm_view(cfg, buf.data());
      typed = {v.w, v.b};
    } else {
      auto v = block_view(cfg, buf.data());
      typed = {v.ln1_w, v.ln1_b, v.qkv_w, v.qkv_b, v.attn_proj_w, v.attn_proj_b,
               v.ln2_w, v.ln2_b, v.fc_w,  v.fc_b,  v.mlp_proj_w,  v.mlp_proj_b};
    }
    ASSERT_EQ(typed.size(), view.tensors().size());
    int64_t offset = 0;
    for (size_t i = 0; i < typed.size(); ++i) {
      const auto& t = view.tensors()[i];
      EXPECT_EQ(t.offset, offset) << t.spec.name;
      EXPECT_EQ(typed[i], buf.data() + t.offset) << t.spec.name;
      offset += t.spec.numel();
    }
  }
  std::vector<float> buf(static_cast<size_t>(unit_numel(UnitKind::kBlock, cfg)));
  UnitView view(UnitKind::kBlock, cfg, buf.data());
  auto fc = view.find("fc_w");
  ASSERT_TRUE(fc.is_ok());
  EXPECT_EQ(fc->spec.shape, (std::vector<int64_t>{4 * 48, 48}));
  auto missing = view.find("wte");
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.status().message().find("ln1_w, ln1_b, qkv_w"), std::string::npos);
}

TEST(GptParams, InitialisationFollowsGpt2AndIsAPureFunction) {
  const GptConfig cfg = *preset("small");
  const auto block = unit_params(UnitKind::kBlock, cfg);
  const ParamSpec& qkv = block[2];
  const ParamSpec& proj = block[4];
  ASSERT_EQ(qkv.name, "qkv_w");
  ASSERT_EQ(proj.name, "attn_proj_w");
  EXPECT_FLOAT_EQ(qkv.init_std, 0.02f);
  EXPECT_FLOAT_EQ(proj.init_std, 0.02f / std::sqrt(2.0f * cfg.layers));
  EXPECT_TRUE(qkv.weight_decay);
  EXPECT_FALSE(block[0].weight_decay);
  EXPECT_EQ(init_value(block[0], 5, 1, 1), 1.0f);  // ln1_w
  EXPECT_EQ(init_value(block[1], 5, 1, 1), 0.0f);  // ln1_b

  // Same coordinates, same value; another seed, unit or element, another value.
  EXPECT_EQ(init_value(qkv, 123, 7, 3), init_value(qkv, 123, 7, 3));
  EXPECT_NE(init_value(qkv, 123, 7, 3), init_value(qkv, 123, 8, 3));
  EXPECT_NE(init_value(qkv, 123, 7, 3), init_value(qkv, 123, 7, 4));
  EXPECT_NE(init_value(qkv, 123, 7, 3), init_value(qkv, 124, 7, 3));

  // Moments of a normal(0, 0.02) over the tensor.
  const int64_t n = qkv.numel();
  double sum = 0, sq = 0;
  int beyond_3_sigma = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = init_value(qkv, static_cast<uint64_t>(i), 42, 1);
    sum += v;
    sq += v * v;
    beyond_3_sigma += std::abs(v) > 3 * 0.02;
  }
  const double mean = sum / n;
  const double std = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 4 * 0.02 / std::sqrt(double(n)));
  EXPECT_NEAR(std, 0.02, 0.02 * 0.01);
  EXPECT_NEAR(beyond_3_sigma / double(n), 0.0027, 0.001);
}

}  // namespace
}  // namespace zinf::gpt
