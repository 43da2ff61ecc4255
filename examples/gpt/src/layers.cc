#include "zinf/gpt/layers.h"

#include <cblas.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/gpt/layer_math.h"

namespace zinf::gpt {
namespace {

// Work (in element operations) below which a loop is not worth splitting, and the target size of
// one chunk when it is.
constexpr int64_t kChunkWork = int64_t{1} << 15;
// The same for matrix products, in multiply-adds.
constexpr int64_t kGemmChunkMacs = int64_t{1} << 21;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kChunkWork / std::max<int64_t>(1, work_per_item));
}

// fn(begin, end) over [0, n) in chunks of at least `grain` items. The items must be independent:
// the chunking may change, the result of each item may not.
template <typename Fn>
void parallel_range(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= grain) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&fn](const tbb::blocked_range<int64_t>& r) { fn(r.begin(), r.end()); });
}

// One thread pool: OpenBLAS's own threads would spin (sched_yield) between products while oneTBB
// runs the loops around them, and the two would fight over the cores; measured on two cores, a
// step of the `small` model took up to twice as long. So every product runs single-threaded in
// OpenBLAS and is split into independent blocks of rows or columns of C that oneTBB spreads.
void use_single_threaded_blas() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

// C[m,n] = alpha * op(A) @ op(B) + beta * C, row-major, on the calling thread.
void sgemm_serial(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                  float* c, int64_t ldc) {
  ZINF_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
                 ldc <= INT_MAX,
             "sgemm {}x{}x{} exceeds the 32-bit BLAS interface", m, n, k);
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

// The same, split over the rows of C (or its columns, when it has more of them) into blocks whose
// size depends on the shape only. Each element of C is still one dot product over the whole of k
// (k is never split), so the result does not depend on how the blocks are scheduled.
void sgemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int64_t m, int64_t n, int64_t k,
           float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
           float* c, int64_t ldc) {
  use_single_threaded_blas();
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  const int64_t per_line = split_rows ? n * k : m * k;
  int64_t block = std::max<int64_t>(16, kGemmChunkMacs / std::max<int64_t>(1, per_line));
  block = (block + 15) / 16 * 16;
  if (block >= extent) {
    sgemm_serial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int64_t blocks = (extent + block - 1) / block;
  parallel_range(blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = i * block;
      const int64_t len = std::min(block, extent - lo);
      if (split_rows) {  // rows lo.. of op(A) and of C
        const float* a_lo = trans_a == CblasNoTrans ? a + lo * lda : a + lo;
        sgemm_serial(trans_a, trans_b, len, n, k, alpha, a_lo, lda, b, ldb, beta, c + lo * ldc,
                     ldc);
      } else {  // columns lo.. of op(B) and of C
        const float* b_lo = trans_b == CblasNoTrans ? b + lo : b + lo * ldb;
        sgemm_serial(trans_a, trans_b, m, len, k, alpha, a, lda, b_lo, ldb, beta, c + lo, ldc);
      }
    }
  });
}

// fn(i) for i in [0, n): independent heads, each a few small products run on its own thread.
template <typename Fn>
void for_each_head(int64_t n, Fn&& fn) {
  use_single_threaded_blas();
  parallel_range(n, 1, [&fn](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i);
  });
}

// db[c] += sum over rows of dy[r, c], rows summed in order; parallel over blocks of columns.
void column_sums_add(const float* dy, int64_t rows, int cols, float* db) {
  constexpr int kBlock = 64;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  parallel_range(blocks, grain_for(rows * kBlock), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int c0 = static_cast<int>(blk) * kBlock;
      const int width = std::min(kBlock, cols - c0);
      float acc[kBlock];
      for (int c = 0; c < width; ++c) acc[c] = db[c0 + c];
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = dy + r * cols + c0;
        for (int c = 0; c < width; ++c) acc[c] += row[c];
      }
      for (int c = 0; c < width; ++c) db[c0 + c] = acc[c];
    }
  });
}

}  // namespace

void layernorm_forward(const float* x, const float* w, const float* b, int64_t rows, int dim,
                       float* y, float* mean, float* rstd) {
  parallel_range(rows, grain_for(3 * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      double sum = 0.0;
      for (int i = 0; i < dim; ++i) sum += xr[i];
      const float m = static_cast<float>(sum / dim);
      double sq = 0.0;
      for (int i = 0; i < dim; ++i) {
        const float d = xr[i] - m;
        sq += d * d;
      }
      const float rs = 1.0f / std::sqrt(static_cast<float>(sq / dim) + kLayerNormEps);
      float* yr = y + r * dim;
      for (int i = 0; i < dim; ++i) yr[i] = (xr[i] - m) * rs * w[i] + b[i];
      mean[r] = m;
      rstd[r] = rs;
    }
  });
}

void layernorm_backward(const float* dy, const float* x, const float* w, const float* mean,
                        const float* rstd, int64_t rows, int dim, float* dx, float* dw, float* db) {
  // dx: with xhat = (x - mean) * rstd and g = dy * w,
  //   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
  parallel_range(rows, grain_for(4 * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      const float* dyr = dy + r * dim;
      const float m = mean[r];
      const float rs = rstd[r];
      double g_sum = 0.0;
      double gx_sum = 0.0;
      for (int i = 0; i < dim; ++i) {
        const float g = dyr[i] * w[i];
        g_sum += g;
        gx_sum += g * ((xr[i] - m) * rs);
      }
      const float g_mean = static_cast<float>(g_sum / dim);
      const float gx_mean = static_cast<float>(gx_sum / dim);
      float* dxr = dx + r * dim;
      for (int i = 0; i < dim; ++i) {
        const float xhat = (xr[i] - m) * rs;
        dxr[i] += rs * (dyr[i] * w[i] - g_mean - xhat * gx_mean);
      }
    }
  });
  // dw, db: sums over rows, in row order, parallel over column blocks.
  constexpr int kBlock = 64;
  const int64_t blocks = (dim + kBlock - 1) / kBlock;
  parallel_range(blocks, grain_for(rows * kBlock), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int c0 = static_cast<int>(blk) * kBlock;
      const int width = std::min(kBlock, dim - c0);
      float acc_w[kBlock];
      float acc_b[kBlock];
      for (int c = 0; c < width; ++c) {
        acc_w[c] = dw[c0 + c];
        acc_b[c] = db[c0 + c];
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim + c0;
        const float* dyr = dy + r * dim + c0;
        const float m = mean[r];
        const float rs = rstd[r];
        for (int c = 0; c < width; ++c) {
          acc_w[c] += dyr[c] * ((xr[c] - m) * rs);
          acc_b[c] += dyr[c];
        }
      }
      for (int c = 0; c < width; ++c) {
        dw[c0 + c] = acc_w[c];
        db[c0 + c] = acc_b[c];
      }
    }
  });
}

void matmul_forward(const float* x, const float* w, const float* b, int64_t rows, int in, int out,
                    float* y) {
  float beta = 0.0f;
  if (b != nullptr) {
    parallel_range(rows, grain_for(out), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) std::copy(b, b + out, y + r * out);
    });
    beta = 1.0f;
  }
  sgemm(CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, w, in, beta, y, out);
}

void matmul_backward(const float* dy, const float* x, const float* w, int64_t rows, int in, int out,
                     float* dx, float* dw, float* db) {
  if (dx != nullptr) {
    sgemm(CblasNoTrans, CblasNoTrans, rows, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
  }
  sgemm(CblasTrans, CblasNoTrans, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (db != nullptr) column_sums_add(dy, rows, out, db);
}

// The element functions are layer_math.h's, shared with the CUDA kernels.
void gelu_forward(const float* x, int64_t n, float* y) {
  parallel_range(n, kChunkWork / 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = gelu_value(x[i]);
  });
}

void gelu_backward(const float* dy, const float* x, int64_t n, float* dx) {
  parallel_range(n, kChunkWork / 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dx[i] = gelu_gradient(dy[i], x[i]);
  });
}

void attention_forward(const float* qkv, int batch, int seq, int dim, int heads, float* att,
                       float* y) {
  const int hd = dim / heads;
  const int64_t T = seq;
  const int64_t ld = 3 * int64_t{dim};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for_each_head(int64_t{batch} * heads, [&](int64_t bh) {
    const int64_t b = bh / heads;
    const int64_t h = bh % heads;
    const float* q = qkv + b * T * ld + h * hd;
    const float* k = q + dim;
    const float* v = q + 2 * dim;
    float* p = att + bh * T * T;
    // Scores for every (query, key) pair; those above the diagonal are masked below.
    sgemm_serial(CblasNoTrans, CblasTrans, T, T, hd, scale, q, ld, k, ld, 0.0f, p, T);
    for (int64_t t = 0; t < T; ++t) {
      float* row = p + t * T;
      float max = row[0];
      for (int64_t j = 1; j <= t; ++j) max = std::max(max, row[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j <= t; ++j) {
        row[j] = std::exp(row[j] - max);
        sum += row[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j <= t; ++j) row[j] *= inv;
      for (int64_t j = t + 1; j < T; ++j) row[j] = 0.0f;
    }
    sgemm_serial(CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, v, ld, 0.0f,
                 y + b * T * dim + h * hd, dim);
  });
}

void attention_backward(const float* dy, const float* qkv, const float* att, int batch, int seq,
                        int dim, int heads, float* dqkv) {
  const int hd = dim / heads;
  const int64_t T = seq;
  const int64_t ld = 3 * int64_t{dim};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for_each_head(int64_t{batch} * heads, [&](int64_t bh) {
    const int64_t b = bh / heads;
    const int64_t h = bh % heads;
    const float* q = qkv + b * T * ld + h * hd;
    const float* k = q + dim;
    const float* v = q + 2 * dim;
    const float* p = att + bh * T * T;
    const float* dy_h = dy + b * T * dim + h * hd;
    float* dq = dqkv + b * T * ld + h * hd;
    float* dk = dq + dim;
    float* dv = dq + 2 * dim;
    // Per-thread scratch for dP, then dS; reused across calls.
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(T * T));
    float* ds = scratch.data();
    sgemm_serial(CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dy_h, dim, v, ld, 0.0f, ds, T);  // dP
    sgemm_serial(CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dy_h, dim, 0.0f, dv,
                 ld);  // P^T dY
    // Softmax backward: dS = P * (dP - sum_j P dP); zero above the diagonal, where P is zero.
    for (int64_t t = 0; t < T; ++t) {
      const float* pr = p + t * T;
      float* row = ds + t * T;
      float dot = 0.0f;
      for (int64_t j = 0; j <= t; ++j) dot += pr[j] * row[j];
      for (int64_t j = 0; j <= t; ++j) row[j] = pr[j] * (row[j] - dot);
      for (int64_t j = t + 1; j < T; ++j) row[j] = 0.0f;
    }
    // S = scale * Q K^T: dQ = scale * dS K, dK = scale * dS^T Q.
    sgemm_serial(CblasNoTrans, CblasNoTrans, T, hd, T, scale, ds, T, k, ld, 0.0f, dq, ld);
    sgemm_serial(CblasTrans, CblasNoTrans, T, hd, T, scale, ds, T, q, ld, 0.0f, dk, ld);
  });
}

void embedding_forward(const int32_t* tokens, const float* wte, const float* wpe, int batch,
                       int seq, int dim, float* x) {
  const int64_t rows = int64_t{batch} * seq;
  parallel_range(rows, grain_for(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* te = wte + int64_t{tokens[r]} * dim;
      const float* pe = wpe + (r % seq) * dim;
      float* xr = x + r * dim;
      for (int i = 0; i < dim; ++i) xr[i] = te[i] + pe[i];
    }
  });
}

void embedding_backward(const float* dx, const int32_t* tokens, int batch, int seq, int dim,
                        float* dwte, float* dwpe) {
  // Rows that share a token (or a position) add into the same gradient row: go over the rows in
  // order and split the work by columns instead.
  const int64_t rows = int64_t{batch} * seq;
  constexpr int kBlock = 64;
  const int64_t blocks = (dim + kBlock - 1) / kBlock;
  parallel_range(blocks, grain_for(rows * kBlock), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int c0 = static_cast<int>(blk) * kBlock;
      const int width = std::min(kBlock, dim - c0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* dxr = dx + r * dim + c0;
        float* te = dwte + int64_t{tokens[r]} * dim + c0;
        float* pe = dwpe + (r % seq) * dim + c0;
        for (int c = 0; c < width; ++c) {
          te[c] += dxr[c];
          pe[c] += dxr[c];
        }
      }
    }
  });
}

double crossentropy_forward_backward(const float* logits, const int32_t* targets, int64_t rows,
                                     int vocab, float loss_scale, float* dlogits) {
  std::vector<double> row_loss(static_cast<size_t>(rows));
  const float k = loss_scale / static_cast<float>(rows);
  parallel_range(rows, grain_for(2 * vocab), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* lr = logits + r * vocab;
      const int32_t target = targets[r];
      ZINF_CHECK(target >= 0 && target < vocab, "target {} at row {} outside [0, {})", target, r,
                 vocab);
      float max = lr[0];
      for (int j = 1; j < vocab; ++j) max = std::max(max, lr[j]);
      double sum = 0.0;
      for (int j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(lr[j] - max));
      const double lse = max + std::log(sum);
      row_loss[r] = lse - lr[target];
      if (dlogits != nullptr) {
        float* dr = dlogits + r * vocab;  // may be lr: each element is read before it is written
        for (int j = 0; j < vocab; ++j) {
          const float prob = static_cast<float>(std::exp(lr[j] - lse));
          dr[j] = k * (prob - (j == target ? 1.0f : 0.0f));
        }
      }
    }
  });
  double total = 0.0;
  for (double l : row_loss) total += l;
  return total / static_cast<double>(rows);
}

}  // namespace zinf::gpt
