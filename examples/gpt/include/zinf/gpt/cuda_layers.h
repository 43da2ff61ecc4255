// The GPT's layers on a CUDA GPU: the functions of layers.h over device memory, enqueued on one
// stream. Plain C++ (no CUDA headers), so C++20 code can call it.
//
// Each function computes what its CPU namesake computes, on the same row-major layouts, with the
// same conventions (outputs overwritten, parameter gradients accumulated). How close the results
// are, per function (checked element by element against layers.cc in tests/gpu):
//  - gelu_forward/backward, embedding_forward/backward, the bias and layer-norm parameter
//    gradients (column sums in row order): the same operations in the same order as the CPU,
//    through layer_math.h; bit-equal.
//  - matmul_*: cuBLAS in fp32 (no TF32), so the dot products are summed in another order: within
//    a few ulps of the CPU times the length of the dot product. With bf16/fp16 inputs
//    (set_matmul_inputs), the same bound against the CPU's product of the rounded operands.
//  - layernorm_* (row sums), attention_* (cuBLAS and expf), crossentropy (exp and log in double):
//    within a stated relative bound (see the test).
//
// Errors are sticky, as on a CUDA stream: a failed launch or cuBLAS call is recorded in the Gpu
// and every later call does nothing until error() is read; check it at the points where the
// caller can act (after a unit, a micro-step).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "zinf/core/dtype.h"

namespace zinf::gpt::cuda {

// Usable CUDA devices; 0 without a GPU or a driver (never an error).
int device_count();

// Loads cuBLAS (once per process) and resolves the functions the layers call; false with *error
// saying why. Gpu::create does this itself: cuBLAS is not loaded before a GPU model needs it,
// since loading it costs about 210 MB of resident memory (libcublasLt), CPU runs included.
bool cublas_loads(std::string* error);

// A stream on one GPU, a cuBLAS handle bound to it, and scratch for the layers. Every call makes
// the GPU current on the calling thread first.
class Gpu {
 public:
  // On GPU `ordinal`. Null (with *error set) when it is not usable or a resource cannot be made.
  static std::unique_ptr<Gpu> create(int ordinal, std::string* error);
  ~Gpu();
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;

  // The cudaStream_t the layers run on.
  void* stream() const;

  // The element type of the linear layers' matrix-product inputs (matmul_forward/backward):
  // fp32 (the default), or bf16/fp16 for a run in that precision: the operands are rounded to
  // it (round to nearest even) and multiplied on the tensor cores with fp32 accumulation and fp32
  // results (cublasGemmEx, CUBLAS_COMPUTE_32F). Attention's products stay fp32.
  void set_matmul_inputs(DType dtype);
  DType matmul_inputs() const;

  // The first failure since the last call ("" when none), cleared.
  std::string error();
  // Waits for everything enqueued; returns error().
  std::string synchronize();

  // Device memory (cudaMallocAsync on the stream: stream ordered); null on failure, recorded.
  void* alloc(size_t bytes);
  void free(void* p);
  // Copies in stream order; `host` must stay valid until the stream reaches the copy (pinned or
  // pageable; pageable copies return once the source is read).
  void to_device(void* dst, const void* host, size_t bytes);
  void to_host(void* host, const void* src, size_t bytes);
  void zero(void* dst, size_t bytes);

  struct Impl;
  Impl& impl();  // with the GPU made current

 private:
  explicit Gpu(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A device buffer of n elements of T, freed in stream order.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept { swap(o); }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    DeviceArray t(std::move(o));
    swap(t);
    return *this;
  }
  ~DeviceArray() { reset(); }

  // Keeps the buffer when it already holds n elements; otherwise a new (uninitialised) one.
  void resize(Gpu& gpu, size_t n) {
    if (gpu_ == &gpu && n == size_) return;
    reset();
    gpu_ = &gpu;
    data_ = n == 0 ? nullptr : static_cast<T*>(gpu.alloc(n * sizeof(T)));
    size_ = data_ != nullptr ? n : 0;  // a failed allocation is recorded in the Gpu
  }
  void reset() {
    if (data_ != nullptr) gpu_->free(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  void swap(DeviceArray& o) noexcept {
    std::swap(gpu_, o.gpu_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  Gpu* gpu_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

// ---- the layers (device pointers; see layers.h for each one's contract) ----

void layernorm_forward(Gpu& g, const float* x, const float* w, const float* b, int64_t rows,
                       int dim, float* y, float* mean, float* rstd);
void layernorm_backward(Gpu& g, const float* dy, const float* x, const float* w, const float* mean,
                        const float* rstd, int64_t rows, int dim, float* dx, float* dw, float* db);

void matmul_forward(Gpu& g, const float* x, const float* w, const float* b, int64_t rows, int in,
                    int out, float* y);
void matmul_backward(Gpu& g, const float* dy, const float* x, const float* w, int64_t rows, int in,
                     int out, float* dx, float* dw, float* db);

void gelu_forward(Gpu& g, const float* x, int64_t n, float* y);
void gelu_backward(Gpu& g, const float* dy, const float* x, int64_t n, float* dx);

void attention_forward(Gpu& g, const float* qkv, int batch, int seq, int dim, int heads, float* att,
                       float* y);
void attention_backward(Gpu& g, const float* dy, const float* qkv, const float* att, int batch,
                        int seq, int dim, int heads, float* dqkv);

// tokens: device memory, each in [0, vocab) (the caller checks them on the host).
void embedding_forward(Gpu& g, const int32_t* tokens, const float* wte, const float* wpe, int batch,
                       int seq, int dim, float* x);
void embedding_backward(Gpu& g, const float* dx, const int32_t* tokens, int batch, int seq, int dim,
                        float* dwte, float* dwpe);

// targets: device memory, each in [0, vocab). Synchronizes (the mean loss is read back); returns
// NaN when the Gpu has an error.
double crossentropy_forward_backward(Gpu& g, const float* logits, const int32_t* targets,
                                     int64_t rows, int vocab, float loss_scale, float* dlogits);

// x[i] = a[i] + b[i] (x may alias a or b); y[i] = x[i] (copy).
void add(Gpu& g, const float* a, const float* b, int64_t n, float* out);
void copy(Gpu& g, const float* src, int64_t n, float* dst);

}  // namespace zinf::gpt::cuda
