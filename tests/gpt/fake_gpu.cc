// cuda_layers.h implemented on the host with the CPU layers (layers.h): "device" memory is host
// memory and every layer is its CPU namesake. Linked with gpu_model.cc into a CPU test, it checks
// GpuModel's orchestration (the order of the layers, the buffers, the copies and aliases, the
// callbacks) against Model bit for bit on machines without a GPU; the CUDA kernels themselves are
// tests/gpu's.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "zinf/gpt/cuda_layers.h"
#include "zinf/gpt/layers.h"

namespace zinf::gpt::cuda {

struct Gpu::Impl {
  DType matmul_inputs = DType::kF32;
  std::vector<void*> live;
};

namespace {
std::atomic<int64_t> layers_run{0};      // layer calls, for tests that check this path ran
std::atomic<int64_t> products_16bit{0};  // matmuls asked for with bf16/fp16 inputs
void ran() { layers_run.fetch_add(1, std::memory_order_relaxed); }
void count_product(const Gpu::Impl& g) {
  if (g.matmul_inputs != DType::kF32) products_16bit.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

int64_t fake_gpu_layers_run() { return layers_run.load(); }
// The stand-in computes every product in fp32 (the rounding is the CUDA layers' and tests/gpu's);
// it counts the ones the trainer asked for in 16 bits.
int64_t fake_gpu_16bit_products() { return products_16bit.load(); }

int device_count() { return 1; }

// Any ordinal: the trainer picks one per rank from the real GPU count, which a CUDA build on a
// machine with GPUs sees.
std::unique_ptr<Gpu> Gpu::create(int, std::string*) {
  return std::unique_ptr<Gpu>(new Gpu(std::make_unique<Impl>()));
}

Gpu::Gpu(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gpu::~Gpu() {
  for (void* p : impl_->live) std::free(p);
}
Gpu::Impl& Gpu::impl() { return *impl_; }
void* Gpu::stream() const { return nullptr; }
void Gpu::set_matmul_inputs(DType dtype) { impl_->matmul_inputs = dtype; }
DType Gpu::matmul_inputs() const { return impl_->matmul_inputs; }
std::string Gpu::error() { return {}; }
std::string Gpu::synchronize() { return {}; }

void* Gpu::alloc(size_t bytes) {
  // Poisoned, as fresh device memory is garbage: a buffer read before it is written shows.
  void* p = std::malloc(bytes);
  std::memset(p, 0xff, bytes);  // NaN as floats
  impl_->live.push_back(p);
  return p;
}
void Gpu::free(void* p) {
  for (auto it = impl_->live.begin(); it != impl_->live.end(); ++it) {
    if (*it == p) {
      std::free(p);
      impl_->live.erase(it);
      return;
    }
  }
}
void Gpu::to_device(void* dst, const void* host, size_t bytes) { std::memcpy(dst, host, bytes); }
void Gpu::to_host(void* host, const void* src, size_t bytes) { std::memcpy(host, src, bytes); }
void Gpu::zero(void* dst, size_t bytes) { std::memset(dst, 0, bytes); }

void layernorm_forward(Gpu&, const float* x, const float* w, const float* b, int64_t rows, int dim,
                       float* y, float* mean, float* rstd) {
  ran();
  gpt::layernorm_forward(x, w, b, rows, dim, y, mean, rstd);
}
void layernorm_backward(Gpu&, const float* dy, const float* x, const float* w, const float* mean,
                        const float* rstd, int64_t rows, int dim, float* dx, float* dw, float* db) {
  ran();
  gpt::layernorm_backward(dy, x, w, mean, rstd, rows, dim, dx, dw, db);
}
void matmul_forward(Gpu& g, const float* x, const float* w, const float* b, int64_t rows, int in,
                    int out, float* y) {
  ran();
  count_product(g.impl());
  gpt::matmul_forward(x, w, b, rows, in, out, y);
}
void matmul_backward(Gpu& g, const float* dy, const float* x, const float* w, int64_t rows, int in,
                     int out, float* dx, float* dw, float* db) {
  ran();
  count_product(g.impl());
  gpt::matmul_backward(dy, x, w, rows, in, out, dx, dw, db);
}
void gelu_forward(Gpu&, const float* x, int64_t n, float* y) {
  ran();
  gpt::gelu_forward(x, n, y);
}
void gelu_backward(Gpu&, const float* dy, const float* x, int64_t n, float* dx) {
  ran();
  gpt::gelu_backward(dy, x, n, dx);
}
void attention_forward(Gpu&, const float* qkv, int batch, int seq, int dim, int heads, float* att,
                       float* y) {
  ran();
  gpt::attention_forward(qkv, batch, seq, dim, heads, att, y);
}
void attention_backward(Gpu&, const float* dy, const float* qkv, const float* att, int batch,
                        int seq, int dim, int heads, float* dqkv) {
  ran();
  gpt::attention_backward(dy, qkv, att, batch, seq, dim, heads, dqkv);
}
void embedding_forward(Gpu&, const int32_t* tokens, const float* wte, const float* wpe, int batch,
                       int seq, int dim, float* x) {
  ran();
  gpt::embedding_forward(tokens, wte, wpe, batch, seq, dim, x);
}
void embedding_backward(Gpu&, const float* dx, const int32_t* tokens, int batch, int seq, int dim,
                        float* dwte, float* dwpe) {
  ran();
  gpt::embedding_backward(dx, tokens, batch, seq, dim, dwte, dwpe);
}
double crossentropy_forward_backward(Gpu&, const float* logits, const int32_t* targets,
                                     int64_t rows, int vocab, float loss_scale, float* dlogits) {
  ran();
  return gpt::crossentropy_forward_backward(logits, targets, rows, vocab, loss_scale, dlogits);
}
void add(Gpu&, const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
void copy(Gpu&, const float* src, int64_t n, float* dst) {
  if (src != dst) std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace zinf::gpt::cuda
