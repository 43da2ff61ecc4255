// The CPU kernels of the GPT example, on raw fp32 row-major arrays. The units (units.h) are built
// from these; they are public so that each one can be checked on its own against finite
// differences.
//
// Conventions:
//  - `rows` is B*T; every activation is [rows, width] row-major.
//  - Matrix products go to OpenBLAS sgemm, split by oneTBB into blocks of rows or columns of the
//    output (never of the inner dimension), each block a single-threaded sgemm: the first call
//    sets OpenBLAS to one thread for the whole process, so that only oneTBB's pool runs.
//  - The other loops run under oneTBB over independent rows, heads or column blocks only. So every
//    output is computed by one fixed sequence of operations: results are bit-identical run to
//    run, whatever the thread count.
//  - Outputs named dx/y/... are overwritten. Parameter gradients (dw, db) are accumulated (+=).
#pragma once

#include <cstdint>

namespace zinf::gpt {

inline constexpr float kLayerNormEps = 1e-5f;

// y = (x - mean) / sqrt(var + eps) * w + b over each row of `dim` values; saves mean and rstd
// ([rows] each) for the backward.
void layernorm_forward(const float* x, const float* w, const float* b, int64_t rows, int dim,
                       float* y, float* mean, float* rstd);
// dx += d/dx, dw += d/dw, db += d/db.
void layernorm_backward(const float* dy, const float* x, const float* w, const float* mean,
                        const float* rstd, int64_t rows, int dim, float* dx, float* dw, float* db);

// y[rows, out] = x[rows, in] @ w[out, in]^T + b[out] (b may be null).
void matmul_forward(const float* x, const float* w, const float* b, int64_t rows, int in, int out,
                    float* y);
// dx = dy @ w (skipped when dx is null), dw += dy^T @ x, db += column sums of dy (b may be null).
void matmul_backward(const float* dy, const float* x, const float* w, int64_t rows, int in, int out,
                     float* dx, float* dw, float* db);

// GELU, tanh approximation (GPT-2): y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const float* x, int64_t n, float* y);
// dx = dy * gelu'(x); dx may alias dy.
void gelu_backward(const float* dy, const float* x, int64_t n, float* dx);

// Causal multi-head self-attention over qkv [B, T, 3D] (queries, keys, values; head h uses
// columns h*hd .. (h+1)*hd-1 of each third). Writes att [B, H, T, T], the softmax probabilities
// (zero above the diagonal), scaled by 1/sqrt(hd), and y [B, T, D], the heads side by side.
void attention_forward(const float* qkv, int batch, int seq, int dim, int heads, float* att,
                       float* y);
// dqkv [B, T, 3D] = gradient of y given dy [B, T, D] (overwritten).
void attention_backward(const float* dy, const float* qkv, const float* att, int batch, int seq,
                        int dim, int heads, float* dqkv);

// x[b, t] = wte[tokens[b, t]] + wpe[t].
void embedding_forward(const int32_t* tokens, const float* wte, const float* wpe, int batch,
                       int seq, int dim, float* x);
// dwte[tokens[b, t]] += dx[b, t], dwpe[t] += dx[b, t].
void embedding_backward(const float* dx, const int32_t* tokens, int batch, int seq, int dim,
                        float* dwte, float* dwpe);

// Mean cross-entropy of softmax(logits) against targets, over `rows` rows of `vocab` logits,
// summed in double. With `dlogits` non-null also writes dlogits = loss_scale / rows *
// (softmax(logits) - onehot(target)) (dlogits may alias logits).
double crossentropy_forward_backward(const float* logits, const int32_t* targets, int64_t rows,
                                     int vocab, float loss_scale, float* dlogits);

}  // namespace zinf::gpt
