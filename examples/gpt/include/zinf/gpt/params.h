// Parameter layout of the GPT units: one flat fp32 buffer per unit, views are offsets.
//
// A unit's parameters are packed contiguously in the order unit_params() lists them: the offset of
// a tensor is the sum of the sizes of the tensors before it. The Engine may append padding after
// the last tensor (to make shards whole blocks) but never between tensors. The same layout serves
// the gradient buffer, the fp32 master copy and the optimizer states.
//
// Matrices are stored [out, in] (row-major, as torch.nn.Linear): y = x @ W^T + b.
//
//   embedding   wte [V, D], wpe [seq, D]
//   block       ln1_w [D], ln1_b [D], qkv_w [3D, D], qkv_b [3D], attn_proj_w [D, D],
//               attn_proj_b [D], ln2_w [D], ln2_b [D], fc_w [4D, D], fc_b [4D],
//               mlp_proj_w [D, 4D], mlp_proj_b [D]                    (12 D^2 + 13 D values)
//   final_norm  lnf_w [D], lnf_b [D]
//
// qkv_w holds the query, key and value projections one after the other ([3, H, head_dim, D]
// read as rows), so head h's query is rows h*head_dim .. (h+1)*head_dim-1 of the first D rows.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/gpt/config.h"

namespace zinf::gpt {

enum class UnitKind { kEmbedding, kBlock, kFinalNorm };

// Unit u of a model: 0 is the embedding, 1..L the blocks, L+1 the final norm.
UnitKind unit_kind(const GptConfig& cfg, int unit);
// "embedding", "block.0" .. "block.{L-1}", "final_norm".
std::string unit_name(const GptConfig& cfg, int unit);

enum class Init {
  kNormal,  // normal(0, init_std)
  kOnes,    // layer-norm gains
  kZeros,   // biases
};

struct ParamSpec {
  std::string name;            // "qkv_w"; unique within its unit
  std::vector<int64_t> shape;  // row-major
  bool weight_decay = false;   // matrices and embeddings decay; gains and biases do not
  Init init = Init::kZeros;
  float init_std = 0.0f;  // kNormal only: 0.02, residual projections 0.02 / sqrt(2 L) (GPT-2)

  int64_t numel() const;
};

// The tensors of a unit of kind `kind`, in their packing order.
std::vector<ParamSpec> unit_params(UnitKind kind, const GptConfig& cfg);
// Values in a unit's flat buffer before any padding.
int64_t unit_numel(UnitKind kind, const GptConfig& cfg);

// Initial value of element `element_index` (row-major index inside the tensor) of `spec`. A pure
// function of its arguments: a counter-based hash of (seed, unit_salt, spec.name, element_index)
// turned into a normal by Box-Muller, so any split of a tensor across ranks, in any order, gives
// the same values. Pass the unit index as unit_salt so that blocks differ.
float init_value(const ParamSpec& spec, uint64_t element_index, uint64_t seed, uint64_t unit_salt);

// Named tensors over one unit's flat buffer (parameters, gradients or any per-parameter state).
class UnitView {
 public:
  struct Tensor {
    ParamSpec spec;
    int64_t offset;  // in values from the start of the unit's buffer
    float* data;
  };

  UnitView(UnitKind kind, const GptConfig& cfg, float* base);

  std::span<const Tensor> tensors() const { return tensors_; }
  // The tensor called `name`; kNotFound naming the unit's tensors otherwise.
  Result<Tensor> find(std::string_view name) const;
  int64_t numel() const { return numel_; }

 private:
  std::vector<Tensor> tensors_;
  int64_t numel_ = 0;
};

// Typed views for the kernels: F is const float for parameters, float for gradients.
template <typename F>
struct EmbeddingTensors {
  F* wte;  // [V, D]
  F* wpe;  // [seq, D]
};

template <typename F>
struct BlockTensors {
  F* ln1_w;        // [D]
  F* ln1_b;        // [D]
  F* qkv_w;        // [3D, D]
  F* qkv_b;        // [3D]
  F* attn_proj_w;  // [D, D]
  F* attn_proj_b;  // [D]
  F* ln2_w;        // [D]
  F* ln2_b;        // [D]
  F* fc_w;         // [4D, D]
  F* fc_b;         // [4D]
  F* mlp_proj_w;   // [D, 4D]
  F* mlp_proj_b;   // [D]
};

template <typename F>
struct FinalNormTensors {
  F* w;  // [D]
  F* b;  // [D]
};

// The offsets below are the packing order of unit_params(); a test holds them against it.
template <typename F>
EmbeddingTensors<F> embedding_view(const GptConfig& cfg, F* base) {
  return {.wte = base, .wpe = base + int64_t{cfg.vocab} * cfg.dim};
}

template <typename F>
BlockTensors<F> block_view(const GptConfig& cfg, F* base) {
  const int64_t d = cfg.dim;
  BlockTensors<F> v;
  F* p = base;
  auto take = [&p](int64_t n) {
    F* t = p;
    p += n;
    return t;
  };
  v.ln1_w = take(d);
  v.ln1_b = take(d);
  v.qkv_w = take(3 * d * d);
  v.qkv_b = take(3 * d);
  v.attn_proj_w = take(d * d);
  v.attn_proj_b = take(d);
  v.ln2_w = take(d);
  v.ln2_b = take(d);
  v.fc_w = take(4 * d * d);
  v.fc_b = take(4 * d);
  v.mlp_proj_w = take(4 * d * d);
  v.mlp_proj_b = take(d);
  return v;
}

template <typename F>
FinalNormTensors<F> final_norm_view(const GptConfig& cfg, F* base) {
  return {.w = base, .b = base + cfg.dim};
}

}  // namespace zinf::gpt
