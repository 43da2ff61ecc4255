// The matrix products of the GPT's CUDA layers, as the column-major strided-batched calls cuBLAS
// takes (cublasSgemmStridedBatched's arguments). The index arithmetic lives here, apart from the
// kernels, so that a CPU test (tests/gpt/gemm_plan_test.cc) runs the very same calls through a
// column-major BLAS and checks them against the CPU layers: the GPU path's transposes, leading
// dimensions and head strides are proven on machines without a GPU.
//
// Row-major matrices are column-major ones transposed, so row-major C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T: swap the operands and the sizes m and n, keep each op.
#pragma once

#include <cstdint>

namespace zinf::gpt {

// C_i = alpha * op(A_i) @ op(B_i) + beta * C_i for i < count, column-major; X_i = X + i * stride_x.
// op(A) is m x k, op(B) is k x n, C is m x n.
struct GemmCall {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const float* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const float* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  float beta = 0.0f;
  float* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  int count = 1;
};

// The column-major call for the row-major product C[m, n] = alpha op(A) op(B) + beta C.
inline GemmCall row_major_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                               float alpha, const float* a, int64_t lda, const float* b,
                               int64_t ldb, float beta, float* c, int64_t ldc, int count = 1,
                               int64_t stride_a = 0, int64_t stride_b = 0, int64_t stride_c = 0) {
  GemmCall g;
  g.trans_a = trans_b;
  g.trans_b = trans_a;
  g.m = n;
  g.n = m;
  g.k = k;
  g.alpha = alpha;
  g.a = b;
  g.lda = ldb;
  g.stride_a = stride_b;
  g.b = a;
  g.ldb = lda;
  g.stride_b = stride_a;
  g.beta = beta;
  g.c = c;
  g.ldc = ldc;
  g.stride_c = stride_c;
  g.count = count;
  return g;
}

// ---- matmul (layers.h): x [rows, in], w [out, in], y and dy [rows, out] ----

// y = x w^T + beta y (beta 1 when y already holds the bias).
inline GemmCall matmul_forward_gemm(const float* x, const float* w, int64_t rows, int in, int out,
                                    float beta, float* y) {
  return row_major_gemm(false, true, rows, out, in, 1.0f, x, in, w, in, beta, y, out);
}
// dx = dy w.
inline GemmCall matmul_dx_gemm(const float* dy, const float* w, int64_t rows, int in, int out,
                               float* dx) {
  return row_major_gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
}
// dw += dy^T x.
inline GemmCall matmul_dw_gemm(const float* dy, const float* x, int64_t rows, int in, int out,
                               float* dw) {
  return row_major_gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

// ---- attention (layers.h), one sequence b at a time, every head in one batched call ----
// qkv [B, T, 3D] (head h: columns h*hd.. of each third), att [B, H, T, T], y [B, T, D].

struct AttentionShape {
  int batch, seq, dim, heads;
  int hd() const { return dim / heads; }
  int64_t ld() const { return 3 * int64_t{dim}; }
  int64_t tt() const { return int64_t{seq} * seq; }
  const float* q(const float* qkv, int b) const { return qkv + int64_t{b} * seq * ld(); }
  float* q(float* qkv, int b) const { return qkv + int64_t{b} * seq * ld(); }
};

// att_b = scale * Q K^T (every (query, key) pair; the softmax then masks above the diagonal).
inline GemmCall attention_scores_gemm(const AttentionShape& s, const float* qkv, int b, float scale,
                                      float* att) {
  const float* q = s.q(qkv, b);
  return row_major_gemm(false, true, s.seq, s.seq, s.hd(), scale, q, s.ld(), q + s.dim, s.ld(),
                        0.0f, att + int64_t{b} * s.heads * s.tt(), s.seq, s.heads, s.hd(), s.hd(),
                        s.tt());
}
// y_b (heads side by side) = P V.
inline GemmCall attention_values_gemm(const AttentionShape& s, const float* qkv, const float* att,
                                      int b, float* y) {
  return row_major_gemm(false, false, s.seq, s.hd(), s.seq, 1.0f,
                        att + int64_t{b} * s.heads * s.tt(), s.seq, s.q(qkv, b) + 2 * s.dim, s.ld(),
                        0.0f, y + int64_t{b} * s.seq * s.dim, s.dim, s.heads, s.tt(), s.hd(),
                        s.hd());
}
// dP (into ds [H, T, T]) = dY V^T.
inline GemmCall attention_dp_gemm(const AttentionShape& s, const float* dy, const float* qkv, int b,
                                  float* ds) {
  return row_major_gemm(false, true, s.seq, s.seq, s.hd(), 1.0f, dy + int64_t{b} * s.seq * s.dim,
                        s.dim, s.q(qkv, b) + 2 * s.dim, s.ld(), 0.0f, ds, s.seq, s.heads, s.hd(),
                        s.hd(), s.tt());
}
// dV = P^T dY.
inline GemmCall attention_dv_gemm(const AttentionShape& s, const float* att, const float* dy, int b,
                                  float* dqkv) {
  return row_major_gemm(true, false, s.seq, s.hd(), s.seq, 1.0f,
                        att + int64_t{b} * s.heads * s.tt(), s.seq, dy + int64_t{b} * s.seq * s.dim,
                        s.dim, 0.0f, s.q(dqkv, b) + 2 * s.dim, s.ld(), s.heads, s.tt(), s.hd(),
                        s.hd());
}
// dQ = scale * dS K.
inline GemmCall attention_dq_gemm(const AttentionShape& s, const float* ds, const float* qkv, int b,
                                  float scale, float* dqkv) {
  return row_major_gemm(false, false, s.seq, s.hd(), s.seq, scale, ds, s.seq, s.q(qkv, b) + s.dim,
                        s.ld(), 0.0f, s.q(dqkv, b), s.ld(), s.heads, s.tt(), s.hd(), s.hd());
}
// dK = scale * dS^T Q.
inline GemmCall attention_dk_gemm(const AttentionShape& s, const float* ds, const float* qkv, int b,
                                  float scale, float* dqkv) {
  return row_major_gemm(true, false, s.seq, s.hd(), s.seq, scale, ds, s.seq, s.q(qkv, b), s.ld(),
                        0.0f, s.q(dqkv, b) + s.dim, s.ld(), s.heads, s.tt(), s.hd(), s.hd());
}

}  // namespace zinf::gpt
