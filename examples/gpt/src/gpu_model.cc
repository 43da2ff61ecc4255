#include "zinf/gpt/gpu_model.h"

#include <climits>

#include "zinf/gpt/params.h"

namespace zinf::gpt::cuda {
namespace {

template <typename T>
void size_to(Gpu& gpu, DeviceArray<T>& a, int64_t n) {
  a.resize(gpu, static_cast<size_t>(n));
}

}  // namespace

GpuModel::GpuModel(const GptConfig& cfg, Gpu& gpu)
    : cfg_(cfg), gpu_(gpu), blocks_(static_cast<size_t>(cfg.layers)) {
  const Status s = validate(cfg);
  ZINF_CHECK(s.is_ok(), "{}", s.message());
}

Status GpuModel::sync(std::string_view where) {
  const std::string e = gpu_.synchronize();
  if (e.empty()) return Status();
  return make_error(ErrorCode::kInternal, "GPU, {}: {}", where, e);
}

Status GpuModel::upload(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  if (batch <= 0 || seq <= 0 || seq > cfg_.seq || int64_t{batch} * seq > INT_MAX) {
    return make_error(ErrorCode::kInvalidArgument, "batch {} x seq {} (the model's seq is {})",
                      batch, seq, cfg_.seq);
  }
  const int64_t rows = int64_t{batch} * seq;
  for (int64_t r = 0; r < rows; ++r) {
    if (tokens[r] < 0 || tokens[r] >= cfg_.vocab) {
      return make_error(ErrorCode::kInvalidArgument, "token {} at {} outside [0, {})", tokens[r], r,
                        cfg_.vocab);
    }
    if (targets != nullptr && (targets[r] < 0 || targets[r] >= cfg_.vocab)) {
      return make_error(ErrorCode::kInvalidArgument, "target {} at {} outside [0, {})", targets[r],
                        r, cfg_.vocab);
    }
  }
  size_to(gpu_, tokens_, rows);
  gpu_.to_device(tokens_.data(), tokens, tokens_.bytes());
  if (targets != nullptr) {
    size_to(gpu_, targets_, rows);
    gpu_.to_device(targets_.data(), targets, targets_.bytes());
  }
  // Pageable copies return once the host array is read; the sync names a failure here.
  return sync("uploading the batch");
}

void GpuModel::block_forward(const float* params, float* x, int batch, int seq, Block& a) {
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg_.dim;
  const int64_t n = rows * d;
  for (auto* v : {&a.x_in, &a.ln1_out, &a.att_y, &a.x_mid, &a.ln2_out}) size_to(gpu_, *v, n);
  for (auto* v : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) size_to(gpu_, *v, rows);
  size_to(gpu_, a.qkv, 3 * n);
  size_to(gpu_, a.att, int64_t{batch} * cfg_.heads * seq * seq);
  size_to(gpu_, a.fc_pre, 4 * n);
  size_to(gpu_, a.fc_act, 4 * n);
  const auto p = block_view(cfg_, params);
  Gpu& g = gpu_;
  // As units.cc's block_forward, step for step.
  copy(g, x, n, a.x_in.data());
  layernorm_forward(g, a.x_in.data(), p.ln1_w, p.ln1_b, rows, d, a.ln1_out.data(),
                    a.ln1_mean.data(), a.ln1_rstd.data());
  matmul_forward(g, a.ln1_out.data(), p.qkv_w, p.qkv_b, rows, d, 3 * d, a.qkv.data());
  attention_forward(g, a.qkv.data(), batch, seq, d, cfg_.heads, a.att.data(), a.att_y.data());
  matmul_forward(g, a.att_y.data(), p.attn_proj_w, p.attn_proj_b, rows, d, d, a.x_mid.data());
  add(g, a.x_mid.data(), a.x_in.data(), n, a.x_mid.data());
  layernorm_forward(g, a.x_mid.data(), p.ln2_w, p.ln2_b, rows, d, a.ln2_out.data(),
                    a.ln2_mean.data(), a.ln2_rstd.data());
  matmul_forward(g, a.ln2_out.data(), p.fc_w, p.fc_b, rows, d, 4 * d, a.fc_pre.data());
  gelu_forward(g, a.fc_pre.data(), 4 * n, a.fc_act.data());
  matmul_forward(g, a.fc_act.data(), p.mlp_proj_w, p.mlp_proj_b, rows, 4 * d, d, x);
  add(g, x, a.x_mid.data(), n, x);
}

void GpuModel::block_backward(const float* params, const Block& a, float* dx, float* grads,
                              int batch, int seq) {
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg_.dim;
  const int64_t n = rows * d;
  size_to(gpu_, d_fc_, 4 * n);
  size_to(gpu_, d_ln_, n);
  size_to(gpu_, d_mid_, n);
  size_to(gpu_, d_att_y_, n);
  size_to(gpu_, d_qkv_, 3 * n);
  const auto p = block_view(cfg_, params);
  const auto gr = block_view(cfg_, grads);
  Gpu& g = gpu_;
  // As units.cc's block_backward, step for step; dx is both dx_out and dx_in.
  matmul_backward(g, dx, a.fc_act.data(), p.mlp_proj_w, rows, 4 * d, d, d_fc_.data(), gr.mlp_proj_w,
                  gr.mlp_proj_b);
  gelu_backward(g, d_fc_.data(), a.fc_pre.data(), 4 * n, d_fc_.data());
  matmul_backward(g, d_fc_.data(), a.ln2_out.data(), p.fc_w, rows, d, 4 * d, d_ln_.data(), gr.fc_w,
                  gr.fc_b);
  copy(g, dx, n, d_mid_.data());
  layernorm_backward(g, d_ln_.data(), a.x_mid.data(), p.ln2_w, a.ln2_mean.data(), a.ln2_rstd.data(),
                     rows, d, d_mid_.data(), gr.ln2_w, gr.ln2_b);
  matmul_backward(g, d_mid_.data(), a.att_y.data(), p.attn_proj_w, rows, d, d, d_att_y_.data(),
                  gr.attn_proj_w, gr.attn_proj_b);
  attention_backward(g, d_att_y_.data(), a.qkv.data(), a.att.data(), batch, seq, d, cfg_.heads,
                     d_qkv_.data());
  matmul_backward(g, d_qkv_.data(), a.ln1_out.data(), p.qkv_w, rows, d, 3 * d, d_ln_.data(),
                  gr.qkv_w, gr.qkv_b);
  copy(g, d_mid_.data(), n, dx);
  layernorm_backward(g, d_ln_.data(), a.x_in.data(), p.ln1_w, a.ln1_mean.data(), a.ln1_rstd.data(),
                     rows, d, dx, gr.ln1_w, gr.ln1_b);
}

Status GpuModel::forward(const UnitParamsFn& params, int batch, int seq) {
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg_.dim;
  size_to(gpu_, x_, rows * d);
  {
    const auto p = embedding_view(cfg_, params(0));
    embedding_forward(gpu_, tokens_.data(), p.wte, p.wpe, batch, seq, d, x_.data());
    ZINF_RETURN_IF_ERROR(sync("embedding forward"));
  }
  for (int l = 0; l < cfg_.layers; ++l) {
    block_forward(params(1 + l), x_.data(), batch, seq, blocks_[static_cast<size_t>(l)]);
    ZINF_RETURN_IF_ERROR(sync(unit_name(cfg_, 1 + l) + " forward"));
  }
  const int lnf = cfg_.final_norm_unit();
  for (auto* v : {&lnf_x_, &lnf_out_}) size_to(gpu_, *v, rows * d);
  for (auto* v : {&lnf_mean_, &lnf_rstd_}) size_to(gpu_, *v, rows);
  const auto p = final_norm_view(cfg_, params(lnf));
  copy(gpu_, x_.data(), rows * d, lnf_x_.data());
  layernorm_forward(gpu_, lnf_x_.data(), p.w, p.b, rows, d, lnf_out_.data(), lnf_mean_.data(),
                    lnf_rstd_.data());
  return sync("final_norm forward");
}

Result<double> GpuModel::forward_backward(const UnitParamsFn& params, const UnitGradsFn& grads,
                                          const int32_t* tokens, const int32_t* targets, int batch,
                                          int seq, float loss_scale) {
  ZINF_RETURN_IF_ERROR(upload(tokens, targets, batch, seq));
  ZINF_RETURN_IF_ERROR(forward(params, batch, seq));
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg_.dim;
  size_to(gpu_, dh_, rows * d);
  size_to(gpu_, dx_, rows * d);
  size_to(gpu_, logits_, rows * cfg_.vocab);

  // The tied head: logits = h wte^T, the loss and its gradient in place, then dh and dwte.
  double loss = 0;
  {
    const auto p = embedding_view(cfg_, params(0));
    const auto g = embedding_view(cfg_, grads(0));
    matmul_forward(gpu_, lnf_out_.data(), p.wte, nullptr, rows, d, cfg_.vocab, logits_.data());
    loss = crossentropy_forward_backward(gpu_, logits_.data(), targets_.data(), rows, cfg_.vocab,
                                         loss_scale, logits_.data());
    matmul_backward(gpu_, logits_.data(), lnf_out_.data(), p.wte, rows, d, cfg_.vocab, dh_.data(),
                    g.wte, nullptr);
    ZINF_RETURN_IF_ERROR(sync("head"));
  }
  const int lnf = cfg_.final_norm_unit();
  {
    const auto p = final_norm_view(cfg_, params(lnf));
    const auto g = final_norm_view(cfg_, grads(lnf));
    gpu_.zero(dx_.data(), dx_.bytes());
    layernorm_backward(gpu_, dh_.data(), lnf_x_.data(), p.w, lnf_mean_.data(), lnf_rstd_.data(),
                       rows, d, dx_.data(), g.w, g.b);
    ZINF_RETURN_IF_ERROR(sync("final_norm backward"));
  }
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    const float* p = params(1 + l);
    block_backward(p, blocks_[static_cast<size_t>(l)], dx_.data(), grads(1 + l), batch, seq);
    ZINF_RETURN_IF_ERROR(sync(unit_name(cfg_, 1 + l) + " backward"));
  }
  const auto g = embedding_view(cfg_, grads(0));
  embedding_backward(gpu_, dx_.data(), tokens_.data(), batch, seq, d, g.wte, g.wpe);
  ZINF_RETURN_IF_ERROR(sync("embedding backward"));
  return loss;
}

Result<double> GpuModel::forward_loss(const UnitParamsFn& params, const int32_t* tokens,
                                      const int32_t* targets, int batch, int seq) {
  ZINF_RETURN_IF_ERROR(upload(tokens, targets, batch, seq));
  ZINF_RETURN_IF_ERROR(forward(params, batch, seq));
  const int64_t rows = int64_t{batch} * seq;
  size_to(gpu_, logits_, rows * cfg_.vocab);
  const auto p = embedding_view(cfg_, params(0));
  matmul_forward(gpu_, lnf_out_.data(), p.wte, nullptr, rows, cfg_.dim, cfg_.vocab, logits_.data());
  const double loss = crossentropy_forward_backward(gpu_, logits_.data(), targets_.data(), rows,
                                                    cfg_.vocab, 1.0f, nullptr);
  ZINF_RETURN_IF_ERROR(sync("head"));
  return loss;
}

int64_t GpuModel::activation_bytes() const {
  size_t n = 0;
  for (const auto* v : {&x_, &dx_, &d_fc_, &d_ln_, &d_mid_, &d_att_y_, &d_qkv_, &lnf_x_, &lnf_mean_,
                        &lnf_rstd_, &lnf_out_, &logits_, &dh_}) {
    n += v->bytes();
  }
  for (const Block& b : blocks_) {
    for (const auto* v : {&b.x_in, &b.ln1_mean, &b.ln1_rstd, &b.ln1_out, &b.qkv, &b.att, &b.att_y,
                          &b.x_mid, &b.ln2_mean, &b.ln2_rstd, &b.ln2_out, &b.fc_pre, &b.fc_act}) {
      n += v->bytes();
    }
  }
  return static_cast<int64_t>(n + tokens_.bytes() + targets_.bytes());
}

}  // namespace zinf::gpt::cuda
