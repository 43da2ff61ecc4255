#include "zinf/gpt/units.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "zinf/core/status.h"
#include "zinf/gpt/layers.h"
#include "zinf/gpt/params.h"

namespace zinf::gpt {
namespace {

template <typename T>
void resize_to(std::vector<T>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
}

void check_shape(const GptConfig& cfg, int batch, int seq) {
  ZINF_CHECK(batch > 0 && seq > 0 && seq <= cfg.seq, "batch {} x seq {} (cfg.seq {})", batch, seq,
             cfg.seq);
  ZINF_CHECK(int64_t{batch} * seq <= INT_MAX, "batch {} x seq {} exceeds the BLAS interface", batch,
             seq);
}

// out[i] = a[i] + b[i]; out may alias a or b.
void add(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

void BlockActivations::resize(const GptConfig& cfg, int b, int t) {
  batch = b;
  seq = t;
  const int64_t rows = int64_t{b} * t;
  const int64_t d = cfg.dim;
  for (auto* v : {&x_in, &ln1_out, &att_y, &x_mid, &ln2_out}) resize_to(*v, rows * d);
  for (auto* v : {&ln1_mean, &ln1_rstd, &ln2_mean, &ln2_rstd}) resize_to(*v, rows);
  resize_to(qkv, rows * 3 * d);
  resize_to(att, int64_t{b} * cfg.heads * t * t);
  resize_to(fc_pre, rows * 4 * d);
  resize_to(fc_act, rows * 4 * d);
}

int64_t BlockActivations::bytes() const {
  int64_t n = 0;
  for (const auto* v : {&x_in, &ln1_mean, &ln1_rstd, &ln1_out, &qkv, &att, &att_y, &x_mid,
                        &ln2_mean, &ln2_rstd, &ln2_out, &fc_pre, &fc_act}) {
    n += static_cast<int64_t>(v->size());
  }
  return n * static_cast<int64_t>(sizeof(float));
}

void BlockWorkspace::resize(const GptConfig& cfg, int batch, int seq) {
  const int64_t rows = int64_t{batch} * seq;
  const int64_t d = cfg.dim;
  resize_to(d_fc, rows * 4 * d);
  resize_to(d_ln, rows * d);
  resize_to(d_mid, rows * d);
  resize_to(d_att_y, rows * d);
  resize_to(d_qkv, rows * 3 * d);
}

void FinalNormActivations::resize(const GptConfig& cfg, int b, int t) {
  batch = b;
  seq = t;
  const int64_t rows = int64_t{b} * t;
  resize_to(x, rows * cfg.dim);
  resize_to(out, rows * cfg.dim);
  resize_to(mean, rows);
  resize_to(rstd, rows);
}

// ---- embedding ----

void embedding_forward(const GptConfig& cfg, const float* params, const int32_t* tokens, int batch,
                       int seq, float* x) {
  check_shape(cfg, batch, seq);
  const int64_t rows = int64_t{batch} * seq;
  for (int64_t r = 0; r < rows; ++r) {
    ZINF_CHECK(tokens[r] >= 0 && tokens[r] < cfg.vocab, "token {} at {} outside [0, {})", tokens[r],
               r, cfg.vocab);
  }
  const auto p = embedding_view(cfg, params);
  gpt::embedding_forward(tokens, p.wte, p.wpe, batch, seq, cfg.dim, x);
}

void embedding_backward(const GptConfig& cfg, const float* dx, const int32_t* tokens, int batch,
                        int seq, float* grads) {
  check_shape(cfg, batch, seq);
  const auto g = embedding_view(cfg, grads);
  gpt::embedding_backward(dx, tokens, batch, seq, cfg.dim, g.wte, g.wpe);
}

// ---- block ----

void block_forward(const GptConfig& cfg, const float* params, const float* x_in, int batch, int seq,
                   float* x_out, BlockActivations& a) {
  check_shape(cfg, batch, seq);
  a.resize(cfg, batch, seq);
  const auto p = block_view(cfg, params);
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg.dim;
  const int64_t n = rows * d;

  std::copy(x_in, x_in + n, a.x_in.data());  // first: x_out may alias x_in
  // x_mid = x_in + proj(attention(LN1(x_in)))
  layernorm_forward(a.x_in.data(), p.ln1_w, p.ln1_b, rows, d, a.ln1_out.data(), a.ln1_mean.data(),
                    a.ln1_rstd.data());
  matmul_forward(a.ln1_out.data(), p.qkv_w, p.qkv_b, rows, d, 3 * d, a.qkv.data());
  attention_forward(a.qkv.data(), batch, seq, d, cfg.heads, a.att.data(), a.att_y.data());
  matmul_forward(a.att_y.data(), p.attn_proj_w, p.attn_proj_b, rows, d, d, a.x_mid.data());
  add(a.x_mid.data(), a.x_in.data(), n, a.x_mid.data());
  // x_out = x_mid + proj(gelu(fc(LN2(x_mid))))
  layernorm_forward(a.x_mid.data(), p.ln2_w, p.ln2_b, rows, d, a.ln2_out.data(), a.ln2_mean.data(),
                    a.ln2_rstd.data());
  matmul_forward(a.ln2_out.data(), p.fc_w, p.fc_b, rows, d, 4 * d, a.fc_pre.data());
  gelu_forward(a.fc_pre.data(), rows * 4 * d, a.fc_act.data());
  matmul_forward(a.fc_act.data(), p.mlp_proj_w, p.mlp_proj_b, rows, 4 * d, d, x_out);
  add(x_out, a.x_mid.data(), n, x_out);
}

void block_backward(const GptConfig& cfg, const float* params, const BlockActivations& a,
                    const float* dx_out, float* dx_in, float* grads, BlockWorkspace& ws) {
  const int batch = a.batch;
  const int seq = a.seq;
  check_shape(cfg, batch, seq);
  ws.resize(cfg, batch, seq);
  const auto p = block_view(cfg, params);
  const auto g = block_view(cfg, grads);
  const int64_t rows = int64_t{batch} * seq;
  const int d = cfg.dim;
  const int64_t n = rows * d;

  // MLP branch: x_out = x_mid + mlp_proj(gelu(fc(LN2(x_mid)))).
  matmul_backward(dx_out, a.fc_act.data(), p.mlp_proj_w, rows, 4 * d, d, ws.d_fc.data(),
                  g.mlp_proj_w, g.mlp_proj_b);
  gelu_backward(ws.d_fc.data(), a.fc_pre.data(), rows * 4 * d, ws.d_fc.data());
  matmul_backward(ws.d_fc.data(), a.ln2_out.data(), p.fc_w, rows, d, 4 * d, ws.d_ln.data(), g.fc_w,
                  g.fc_b);
  std::copy(dx_out, dx_out + n, ws.d_mid.data());  // the residual path
  layernorm_backward(ws.d_ln.data(), a.x_mid.data(), p.ln2_w, a.ln2_mean.data(), a.ln2_rstd.data(),
                     rows, d, ws.d_mid.data(), g.ln2_w, g.ln2_b);

  // Attention branch: x_mid = x_in + attn_proj(attention(qkv(LN1(x_in)))).
  matmul_backward(ws.d_mid.data(), a.att_y.data(), p.attn_proj_w, rows, d, d, ws.d_att_y.data(),
                  g.attn_proj_w, g.attn_proj_b);
  attention_backward(ws.d_att_y.data(), a.qkv.data(), a.att.data(), batch, seq, d, cfg.heads,
                     ws.d_qkv.data());
  matmul_backward(ws.d_qkv.data(), a.ln1_out.data(), p.qkv_w, rows, d, 3 * d, ws.d_ln.data(),
                  g.qkv_w, g.qkv_b);
  // dx_out is not read again: dx_in may alias it.
  std::copy(ws.d_mid.data(), ws.d_mid.data() + n, dx_in);
  layernorm_backward(ws.d_ln.data(), a.x_in.data(), p.ln1_w, a.ln1_mean.data(), a.ln1_rstd.data(),
                     rows, d, dx_in, g.ln1_w, g.ln1_b);
}

// ---- final norm ----

void final_norm_forward(const GptConfig& cfg, const float* params, const float* x, int batch,
                        int seq, FinalNormActivations& a) {
  check_shape(cfg, batch, seq);
  a.resize(cfg, batch, seq);
  const auto p = final_norm_view(cfg, params);
  const int64_t rows = int64_t{batch} * seq;
  std::copy(x, x + rows * cfg.dim, a.x.data());
  layernorm_forward(a.x.data(), p.w, p.b, rows, cfg.dim, a.out.data(), a.mean.data(),
                    a.rstd.data());
}

void final_norm_backward(const GptConfig& cfg, const float* params, const FinalNormActivations& a,
                         const float* dh, float* dx, float* grads) {
  check_shape(cfg, a.batch, a.seq);
  const auto p = final_norm_view(cfg, params);
  const auto g = final_norm_view(cfg, grads);
  const int64_t rows = int64_t{a.batch} * a.seq;
  ZINF_CHECK(dh != dx, "final_norm_backward: dx must not alias dh");
  std::fill(dx, dx + rows * cfg.dim, 0.0f);
  layernorm_backward(dh, a.x.data(), p.w, a.mean.data(), a.rstd.data(), rows, cfg.dim, dx, g.w,
                     g.b);
}

// ---- tied head ----

void head_logits(const GptConfig& cfg, const float* embedding_params, const float* h, int64_t rows,
                 float* logits) {
  const auto p = embedding_view(cfg, embedding_params);
  matmul_forward(h, p.wte, nullptr, rows, cfg.dim, cfg.vocab, logits);
}

double head_loss(const GptConfig& cfg, const float* embedding_params, const float* h,
                 const int32_t* targets, int64_t rows, HeadWorkspace& ws) {
  resize_to(ws.logits, rows * cfg.vocab);
  head_logits(cfg, embedding_params, h, rows, ws.logits.data());
  return crossentropy_forward_backward(ws.logits.data(), targets, rows, cfg.vocab, 1.0f, nullptr);
}

double head_loss_backward(const GptConfig& cfg, const float* embedding_params, const float* h,
                          const int32_t* targets, int64_t rows, float loss_scale, float* dh,
                          float* embedding_grads, HeadWorkspace& ws) {
  resize_to(ws.logits, rows * cfg.vocab);
  head_logits(cfg, embedding_params, h, rows, ws.logits.data());
  float* dlogits = ws.logits.data();  // in place
  const double loss = crossentropy_forward_backward(ws.logits.data(), targets, rows, cfg.vocab,
                                                    loss_scale, dlogits);
  const auto p = embedding_view(cfg, embedding_params);
  const auto g = embedding_view(cfg, embedding_grads);
  matmul_backward(dlogits, h, p.wte, rows, cfg.dim, cfg.vocab, dh, g.wte, nullptr);
  return loss;
}

double head_forward_backward(const GptConfig& cfg, const float* final_norm_params,
                             float* final_norm_grads, const float* embedding_params,
                             float* embedding_grads, const float* x, const int32_t* targets,
                             int batch, int seq, float loss_scale, float* dx,
                             FinalNormActivations& acts, HeadWorkspace& ws) {
  final_norm_forward(cfg, final_norm_params, x, batch, seq, acts);
  const int64_t rows = int64_t{batch} * seq;
  resize_to(ws.dh, rows * cfg.dim);
  const double loss = head_loss_backward(cfg, embedding_params, acts.out.data(), targets, rows,
                                         loss_scale, ws.dh.data(), embedding_grads, ws);
  final_norm_backward(cfg, final_norm_params, acts, ws.dh.data(), dx, final_norm_grads);
  return loss;
}

}  // namespace zinf::gpt
