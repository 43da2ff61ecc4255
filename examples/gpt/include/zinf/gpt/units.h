// Forward and backward of each GPT unit over its flat parameter buffer (params.h).
//
// How a driver (the Engine, or Model in model.h) runs one micro-step on B sequences of T tokens
// (T <= cfg.seq); x is the residual stream [B, T, D]:
//
//   forward                                        backward (reverse order)
//   embedding_forward(unit 0)        -> x          head_loss_backward(unit 0 params, unit 0 grads)
//   block_forward(unit 1+l)   x -> x, acts[l]        -> dh
//   final_norm_forward(unit L+1) x -> h            final_norm_backward(unit L+1)      dh -> dx
//   head_loss(unit 0 params) h -> loss             block_backward(unit 1+l, acts[l])  dx -> dx
//                                                  embedding_backward(unit 0 grads)   dx
//
// Each call needs only the parameters of the one unit named (the head uses the embedding's wte),
// so a ZeRO-3 driver gathers one unit at a time. The embedding's gradient buffer receives two
// contributions per micro-step, from the head and from embedding_backward; it must not be reduced
// before both are in. embedding_backward reads no parameters.
//
// Gradients are accumulated (+=) into the unit's flat gradient buffer, so gradient accumulation
// over micro-steps needs nothing more than not zeroing in between. Activations and gradients
// w.r.t. activations are fp32 and overwritten.
#pragma once

#include <cstdint>
#include <vector>

#include "zinf/gpt/config.h"

namespace zinf::gpt {

// What block_forward keeps for block_backward: one per block per micro-batch, kept by the driver
// between the two. About (16 D + H T + 4) * B * T floats.
struct BlockActivations {
  int batch = 0;
  int seq = 0;
  std::vector<float> x_in;                // [B,T,D] block input (layer norm 1 input)
  std::vector<float> ln1_mean, ln1_rstd;  // [B,T]
  std::vector<float> ln1_out;             // [B,T,D]
  std::vector<float> qkv;                 // [B,T,3D]
  std::vector<float> att;                 // [B,H,T,T] softmax probabilities
  std::vector<float> att_y;               // [B,T,D] heads before the output projection
  std::vector<float> x_mid;               // [B,T,D] residual after attention (layer norm 2 input)
  std::vector<float> ln2_mean, ln2_rstd;  // [B,T]
  std::vector<float> ln2_out;             // [B,T,D]
  std::vector<float> fc_pre;              // [B,T,4D] before GELU
  std::vector<float> fc_act;              // [B,T,4D] after GELU

  void resize(const GptConfig& cfg, int batch, int seq);
  int64_t bytes() const;
};

// Scratch for block_backward; one can serve every block in turn.
struct BlockWorkspace {
  std::vector<float> d_fc;     // [B,T,4D]
  std::vector<float> d_ln;     // [B,T,D]
  std::vector<float> d_mid;    // [B,T,D]
  std::vector<float> d_att_y;  // [B,T,D]
  std::vector<float> d_qkv;    // [B,T,3D]

  void resize(const GptConfig& cfg, int batch, int seq);
};

struct FinalNormActivations {
  int batch = 0;
  int seq = 0;
  std::vector<float> x;           // [B,T,D] input
  std::vector<float> mean, rstd;  // [B,T]
  std::vector<float> out;         // [B,T,D] h, the head's input

  void resize(const GptConfig& cfg, int batch, int seq);
};

struct HeadWorkspace {
  std::vector<float> logits;  // [B*T, V]; after head_loss_backward, the logits' gradient
  std::vector<float> dh;      // [B*T, D]; head_forward_backward's gradient at the final norm
};

// ---- embedding (unit 0) ----
// x [B,T,D] = wte[tokens] + wpe[0..T-1]. tokens are in [0, vocab).
void embedding_forward(const GptConfig& cfg, const float* params, const int32_t* tokens, int batch,
                       int seq, float* x);
// Accumulates dx [B,T,D] into the wte rows of the tokens and the wpe rows of the positions.
void embedding_backward(const GptConfig& cfg, const float* dx, const int32_t* tokens, int batch,
                        int seq, float* grads);

// ---- transformer block (units 1..L) ----
// x_out = x_mid + MLP(LN2(x_mid)), x_mid = x_in + Attention(LN1(x_in)). x_out may alias x_in.
void block_forward(const GptConfig& cfg, const float* params, const float* x_in, int batch, int seq,
                   float* x_out, BlockActivations& acts);
// dx_in [B,T,D] from dx_out; dx_in may alias dx_out. Batch and length come from acts.
void block_backward(const GptConfig& cfg, const float* params, const BlockActivations& acts,
                    const float* dx_out, float* dx_in, float* grads, BlockWorkspace& ws);

// ---- final layer norm (unit L+1) ----
// acts.out = LN(x).
void final_norm_forward(const GptConfig& cfg, const float* params, const float* x, int batch,
                        int seq, FinalNormActivations& acts);
// dx [B,T,D] (overwritten) from dh; must not alias dh.
void final_norm_backward(const GptConfig& cfg, const float* params,
                         const FinalNormActivations& acts, const float* dh, float* dx,
                         float* grads);

// ---- tied head: logits = h @ wte^T, wte from the embedding unit ----
// logits [rows, V].
void head_logits(const GptConfig& cfg, const float* embedding_params, const float* h, int64_t rows,
                 float* logits);
// Mean cross-entropy over rows (computed in double).
double head_loss(const GptConfig& cfg, const float* embedding_params, const float* h,
                 const int32_t* targets, int64_t rows, HeadWorkspace& ws);
// The loss, and the backward of loss * loss_scale: dh [rows, D] (overwritten) and the wte
// gradient accumulated into embedding_grads. loss_scale is 1, or 1/k to average k micro-steps,
// or an fp16 loss scale.
double head_loss_backward(const GptConfig& cfg, const float* embedding_params, const float* h,
                          const int32_t* targets, int64_t rows, float loss_scale, float* dh,
                          float* embedding_grads, HeadWorkspace& ws);

// final_norm_forward + head_loss_backward + final_norm_backward in one call, for a driver that
// holds both the final-norm and the embedding units: dx [B,T,D] is the gradient of the loss at
// the final norm's input.
double head_forward_backward(const GptConfig& cfg, const float* final_norm_params,
                             float* final_norm_grads, const float* embedding_params,
                             float* embedding_grads, const float* x, const int32_t* targets,
                             int batch, int seq, float loss_scale, float* dx,
                             FinalNormActivations& acts, HeadWorkspace& ws);

}  // namespace zinf::gpt
