#include "zinf/gpt/model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "random.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {

Model::Model(const GptConfig& cfg) : cfg_(cfg), blocks_(static_cast<size_t>(cfg.layers)) {
  const Status s = validate(cfg);
  ZINF_CHECK(s.is_ok(), "{}", s.message());
}

void Model::forward(const UnitParamsFn& params, const int32_t* tokens, int batch, int seq) {
  const int64_t n = int64_t{batch} * seq * cfg_.dim;
  x_.resize(static_cast<size_t>(n));
  embedding_forward(cfg_, params(0), tokens, batch, seq, x_.data());
  for (int l = 0; l < cfg_.layers; ++l) {
    block_forward(cfg_, params(1 + l), x_.data(), batch, seq, x_.data(), blocks_[l]);
  }
  final_norm_forward(cfg_, params(cfg_.final_norm_unit()), x_.data(), batch, seq, final_norm_);
}

double Model::forward_backward(const UnitParamsFn& params, const UnitGradsFn& grads,
                               const int32_t* tokens, const int32_t* targets, int batch, int seq,
                               float loss_scale) {
  forward(params, tokens, batch, seq);
  const int64_t rows = int64_t{batch} * seq;
  const int64_t n = rows * cfg_.dim;
  head_ws_.dh.resize(static_cast<size_t>(n));
  dx_.resize(static_cast<size_t>(n));

  const float* embedding = params(0);
  const double loss = head_loss_backward(cfg_, embedding, final_norm_.out.data(), targets, rows,
                                         loss_scale, head_ws_.dh.data(), grads(0), head_ws_);
  const int lnf = cfg_.final_norm_unit();
  const float* lnf_params = params(lnf);
  final_norm_backward(cfg_, lnf_params, final_norm_, head_ws_.dh.data(), dx_.data(), grads(lnf));
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    const float* block_params = params(1 + l);
    block_backward(cfg_, block_params, blocks_[l], dx_.data(), dx_.data(), grads(1 + l), block_ws_);
  }
  embedding_backward(cfg_, dx_.data(), tokens, batch, seq, grads(0));
  return loss;
}

double Model::forward_loss(const UnitParamsFn& params, const int32_t* tokens,
                           const int32_t* targets, int batch, int seq) {
  forward(params, tokens, batch, seq);
  return head_loss(cfg_, params(0), final_norm_.out.data(), targets, int64_t{batch} * seq,
                   head_ws_);
}

void Model::forward_logits(const UnitParamsFn& params, const int32_t* tokens, int batch, int seq,
                           float* logits) {
  forward(params, tokens, batch, seq);
  head_logits(cfg_, params(0), final_norm_.out.data(), int64_t{batch} * seq, logits);
}

int64_t Model::activation_bytes() const {
  int64_t n = 0;
  for (const auto* v : {&x_, &dx_, &block_ws_.d_fc, &block_ws_.d_ln, &block_ws_.d_mid,
                        &block_ws_.d_att_y, &block_ws_.d_qkv, &final_norm_.x, &final_norm_.out,
                        &final_norm_.mean, &final_norm_.rstd, &head_ws_.logits, &head_ws_.dh}) {
    n += static_cast<int64_t>(v->size() * sizeof(float));
  }
  for (const BlockActivations& b : blocks_) n += b.bytes();
  return n;
}

double model_forward_backward(const GptConfig& cfg, const UnitParamsFn& params,
                              const UnitGradsFn& grads, const int32_t* tokens,
                              const int32_t* targets, int batch, int seq, float loss_scale) {
  Model model(cfg);
  return model.forward_backward(params, grads, tokens, targets, batch, seq, loss_scale);
}

double model_forward_loss(const GptConfig& cfg, const UnitParamsFn& params, const int32_t* tokens,
                          const int32_t* targets, int batch, int seq) {
  Model model(cfg);
  return model.forward_loss(params, tokens, targets, batch, seq);
}

// ---- LocalParams ----

LocalParams::LocalParams(const GptConfig& cfg) : cfg_(cfg) {
  const Status s = validate(cfg);
  ZINF_CHECK(s.is_ok(), "{}", s.message());
  for (int u = 0; u < cfg.num_units(); ++u) {
    const auto n = static_cast<size_t>(unit_numel(unit_kind(cfg, u), cfg));
    params_.emplace_back(n, 0.0f);
    grads_.emplace_back(n, 0.0f);
  }
}

void LocalParams::init(uint64_t seed) {
  for (int u = 0; u < num_units(); ++u) {
    UnitView view(unit_kind(cfg_, u), cfg_, params_[u].data());
    for (const UnitView::Tensor& t : view.tensors()) {
      const int64_t n = t.spec.numel();
      for (int64_t i = 0; i < n; ++i) {
        t.data[i] = init_value(t.spec, static_cast<uint64_t>(i), seed, static_cast<uint64_t>(u));
      }
    }
  }
}

void LocalParams::zero_grads() {
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
}

UnitParamsFn LocalParams::params_fn() {
  return [this](int unit) -> const float* { return params_.at(unit).data(); };
}

UnitGradsFn LocalParams::grads_fn() {
  return [this](int unit) -> float* { return grads_.at(unit).data(); };
}

// ---- sampling ----

namespace {

// The next token from one row of logits.
int32_t sample_token(const float* logits, int vocab, const SampleOptions& o, uint64_t step) {
  if (o.sampling == Sampling::kGreedy) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  // Candidates by decreasing logit, lower index first on ties.
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const int keep = (o.top_k > 0 && o.top_k < vocab) ? o.top_k : vocab;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [logits](int32_t a, int32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  const double max = logits[order[0]];
  std::vector<double> weight(static_cast<size_t>(keep));
  double total = 0.0;
  for (int i = 0; i < keep; ++i) {
    weight[i] = std::exp((logits[order[i]] - max) / o.temperature);
    total += weight[i];
  }
  const double u = detail::unit_interval(detail::hash_words({o.seed, step})) * total;
  double acc = 0.0;
  for (int i = 0; i < keep; ++i) {
    acc += weight[i];
    if (u < acc) return order[i];
  }
  return order[keep - 1];
}

}  // namespace

Result<std::string> generate(const GptConfig& cfg, const UnitParamsFn& params,
                             std::string_view prompt, int num_bytes, const SampleOptions& options) {
  ZINF_RETURN_IF_ERROR(validate(cfg));
  if (cfg.vocab > 256) {
    return make_error(ErrorCode::kInvalidArgument,
                      "generate: vocab = {} does not fit in bytes (at most 256)", cfg.vocab);
  }
  if (num_bytes < 0) {
    return make_error(ErrorCode::kInvalidArgument, "generate: num_bytes = {} < 0", num_bytes);
  }
  if (options.sampling == Sampling::kRandom && !(options.temperature > 0.0f)) {
    return make_error(ErrorCode::kInvalidArgument, "generate: temperature = {} must be > 0",
                      options.temperature);
  }
  if (options.top_k < 0) {
    return make_error(ErrorCode::kInvalidArgument, "generate: top_k = {} < 0", options.top_k);
  }
  std::vector<int32_t> context;
  for (unsigned char c : (prompt.empty() ? std::string_view("\n") : prompt)) {
    if (c >= cfg.vocab) {
      return make_error(ErrorCode::kInvalidArgument,
                        "generate: prompt byte {} is outside the vocabulary of {}", c, cfg.vocab);
    }
    context.push_back(c);
  }

  Model model(cfg);
  std::string out;
  out.reserve(static_cast<size_t>(num_bytes));
  std::vector<float> logits;
  for (int i = 0; i < num_bytes; ++i) {
    const int seq = static_cast<int>(std::min<size_t>(context.size(), cfg.seq));
    const int32_t* window = context.data() + (context.size() - seq);
    logits.resize(static_cast<size_t>(seq) * cfg.vocab);
    model.forward_logits(params, window, 1, seq, logits.data());
    const int32_t next = sample_token(logits.data() + int64_t{seq - 1} * cfg.vocab, cfg.vocab,
                                      options, static_cast<uint64_t>(i));
    context.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  return out;
}

}  // namespace zinf::gpt
