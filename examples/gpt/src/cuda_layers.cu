// The GPT's layers on CUDA (cuda_layers.h). Compiled with --fmad=false (CMakeLists.txt), so the
// element functions shared with the CPU (layer_math.h) and the column sums give the CPU's bits.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "zinf/gpt/cuda_layers.h"
#include "zinf/gpt/gemm_plan.h"
#include "zinf/gpt/layer_math.h"
#include "zinf/gpt/layers.h"  // kLayerNormEps

namespace zinf::gpt::cuda {

namespace {

// cuBLAS is loaded when it is first needed (a Gpu is made), not when the program starts: its
// libraries (libcublas and libcublasLt, over 500 MB) cost about 210 MB of resident memory just
// to load, which every zinf process would otherwise pay, CPU runs too. These are the functions
// the layers call, resolved by their exported names (cublas_v2.h's macros give the _v2 ones) and
// typed by the header's own declarations.
#define ZINF_CUBLAS_NAME2(f) #f
#define ZINF_CUBLAS_NAME(f) ZINF_CUBLAS_NAME2(f)
struct Blas {
  decltype(&cublasCreate) create = nullptr;
  decltype(&cublasDestroy) destroy = nullptr;
  decltype(&cublasSetStream) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm) sgemm = nullptr;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched = nullptr;
  // cublasGemmEx is overloaded in C++ (a wrapper taking a cudaDataType compute type): the
  // library's own, chosen by its exact type (unevaluated: nothing is linked).
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  decltype(static_cast<GemmEx>(&cublasGemmEx)) gemm_ex = nullptr;
};

// The loaded functions, or nullptr with `error` saying why (once per process; never unloaded).
const Blas* load_blas(std::string* error) {
  static std::once_flag once;
  static Blas blas;
  static std::string failure;
  std::call_once(once, [] {
    const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = nullptr;
    std::string tried;
    // The toolkit's this build was made with, then the loader's search path.
    for (const std::string& name : {std::string(ZINF_CUBLAS_DIR) + "/" + soname, soname}) {
      lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      const char* why = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why != nullptr ? why : name);
    }
    if (lib == nullptr) {
      failure = "cuBLAS could not be loaded: " + tried;
      return;
    }
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      if (fn == nullptr && failure.empty()) failure = soname + " has no " + name;
    };
    resolve(blas.create, ZINF_CUBLAS_NAME(cublasCreate));
    resolve(blas.destroy, ZINF_CUBLAS_NAME(cublasDestroy));
    resolve(blas.set_stream, ZINF_CUBLAS_NAME(cublasSetStream));
    resolve(blas.set_math_mode, ZINF_CUBLAS_NAME(cublasSetMathMode));
    resolve(blas.sgemm, ZINF_CUBLAS_NAME(cublasSgemm));
    resolve(blas.sgemm_strided_batched, ZINF_CUBLAS_NAME(cublasSgemmStridedBatched));
    resolve(blas.gemm_ex, ZINF_CUBLAS_NAME(cublasGemmEx));
  });
  if (!failure.empty()) {
    *error = failure;
    return nullptr;
  }
  return &blas;
}

}  // namespace

bool cublas_loads(std::string* error) { return load_blas(error) != nullptr; }

struct Gpu::Impl {
  int ordinal = 0;
  cudaStream_t stream = nullptr;
  const Blas* api = nullptr;  // cuBLAS, loaded on first use
  cublasHandle_t blas = nullptr;
  std::string error;
  // attention_backward's dP/dS for one sequence of the batch: [H, T, T].
  float* att_scratch = nullptr;
  size_t att_scratch_elems = 0;
  // crossentropy's per-row losses.
  double* row_loss = nullptr;
  size_t row_loss_elems = 0;
  // The linear layers' product inputs, and their 16-bit copies (two operands).
  DType matmul_inputs = DType::kF32;
  uint16_t* half[2] = {nullptr, nullptr};
  size_t half_elems[2] = {0, 0};

  bool failed() const { return !error.empty(); }
  void fail(std::string what) {
    if (error.empty()) error = std::move(what);
  }
  // Records a failed launch (or an earlier asynchronous failure surfacing); true when all is well.
  bool launched(const char* what) {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return true;
    fail(std::string(what) + ": " + cudaGetErrorString(err));
    return false;
  }
  bool ok(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return true;
    fail(std::string(what) + ": " + cudaGetErrorString(err));
    return false;
  }
  bool ok(cublasStatus_t st, const char* what) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    fail(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
    return false;
  }
  // Scratch of at least n elements, kept for later calls.
  template <typename T>
  T* scratch(T*& p, size_t& have, size_t n, const char* what) {
    if (have >= n) return p;
    if (p != nullptr) cudaFreeAsync(p, stream);
    p = nullptr;
    have = 0;
    if (!ok(cudaMallocAsync(reinterpret_cast<void**>(&p), n * sizeof(T), stream), what)) {
      return nullptr;
    }
    have = n;
    return p;
  }
};

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

unsigned blocks_for(int64_t n, int per_block = kThreads) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

__device__ inline int64_t global_index() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}

template <typename T>
__device__ inline T warp_sum(T v) {
  for (int o = kWarp / 2; o >= 1; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o >= 1; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// ---- layer norm: one warp per row ----

__global__ void layernorm_forward_kernel(const float* x, const float* w, const float* b,
                                         int64_t rows, int dim, float* y, float* mean,
                                         float* rstd) {
  const int64_t r = global_index() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* xr = x + r * dim;
  double sum = 0.0;
  for (int i = lane; i < dim; i += kWarp) sum += xr[i];
  sum = warp_sum(sum);
  const float m = static_cast<float>(sum / dim);
  double sq = 0.0;
  for (int i = lane; i < dim; i += kWarp) {
    const float d = xr[i] - m;
    sq += d * d;
  }
  sq = warp_sum(sq);
  const float rs = 1.0f / sqrtf(static_cast<float>(sq / dim) + kLayerNormEps);
  float* yr = y + r * dim;
  for (int i = lane; i < dim; i += kWarp) yr[i] = (xr[i] - m) * rs * w[i] + b[i];
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rs;
  }
}

__global__ void layernorm_backward_dx_kernel(const float* dy, const float* x, const float* w,
                                             const float* mean, const float* rstd, int64_t rows,
                                             int dim, float* dx) {
  const int64_t r = global_index() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* xr = x + r * dim;
  const float* dyr = dy + r * dim;
  const float m = mean[r];
  const float rs = rstd[r];
  double g_sum = 0.0;
  double gx_sum = 0.0;
  for (int i = lane; i < dim; i += kWarp) {
    const float g = dyr[i] * w[i];
    g_sum += g;
    gx_sum += g * ((xr[i] - m) * rs);
  }
  g_sum = warp_sum(g_sum);
  gx_sum = warp_sum(gx_sum);
  const float g_mean = static_cast<float>(g_sum / dim);
  const float gx_mean = static_cast<float>(gx_sum / dim);
  float* dxr = dx + r * dim;
  for (int i = lane; i < dim; i += kWarp) {
    const float xhat = (xr[i] - m) * rs;
    dxr[i] += rs * (dyr[i] * w[i] - g_mean - xhat * gx_mean);
  }
}

// dw, db: one thread per column, the rows added in order (as the CPU does: bit-equal).
__global__ void layernorm_backward_params_kernel(const float* dy, const float* x, const float* mean,
                                                 const float* rstd, int64_t rows, int dim,
                                                 float* dw, float* db) {
  const int64_t c = global_index();
  if (c >= dim) return;
  float acc_w = dw[c];
  float acc_b = db[c];
  for (int64_t r = 0; r < rows; ++r) {
    const float d = dy[r * dim + c];
    acc_w += d * ((x[r * dim + c] - mean[r]) * rstd[r]);
    acc_b += d;
  }
  dw[c] = acc_w;
  db[c] = acc_b;
}

// ---- matrix products' helpers ----

__global__ void broadcast_rows_kernel(const float* b, int64_t rows, int cols, float* y) {
  const int64_t i = global_index();
  if (i < rows * cols) y[i] = b[i % cols];
}

// db[c] += the sum over rows of dy[r, c], rows in order (bit-equal to the CPU's column sums).
__global__ void column_sums_add_kernel(const float* dy, int64_t rows, int cols, float* db) {
  const int64_t c = global_index();
  if (c >= cols) return;
  float acc = db[c];
  for (int64_t r = 0; r < rows; ++r) acc += dy[r * cols + c];
  db[c] = acc;
}

// ---- element-wise ----

__global__ void round_to_16bit_kernel(const float* x, int64_t n, bool bf16, uint16_t* y) {
  const int64_t i = global_index();
  if (i < n) y[i] = bf16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}

__global__ void gelu_forward_kernel(const float* x, int64_t n, float* y) {
  const int64_t i = global_index();
  if (i < n) y[i] = gelu_value(x[i]);
}

__global__ void gelu_backward_kernel(const float* dy, const float* x, int64_t n, float* dx) {
  const int64_t i = global_index();
  if (i < n) dx[i] = gelu_gradient(dy[i], x[i]);
}

__global__ void add_kernel(const float* a, const float* b, int64_t n, float* out) {
  const int64_t i = global_index();
  if (i < n) out[i] = a[i] + b[i];
}

// ---- attention: one warp per row of probabilities ----

// Row t of each [T, T] matrix holds the scaled scores; becomes the causal softmax (zero above the
// diagonal).
__global__ void causal_softmax_kernel(float* att, int64_t matrices, int seq) {
  const int64_t row = global_index() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= matrices * seq) return;
  const int t = static_cast<int>(row % seq);
  float* p = att + row * seq;
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += kWarp) mx = fmaxf(mx, p[j]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int j = lane; j <= t; j += kWarp) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;
  for (int j = lane; j <= t; j += kWarp) p[j] *= inv;
  for (int j = t + 1 + lane; j < seq; j += kWarp) p[j] = 0.0f;
}

// dS = P * (dP - sum_j P dP), in place over dP; zero above the diagonal.
__global__ void softmax_backward_kernel(const float* att, int64_t matrices, int seq, float* ds) {
  const int64_t row = global_index() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= matrices * seq) return;
  const int t = static_cast<int>(row % seq);
  const float* p = att + row * seq;
  float* d = ds + row * seq;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += kWarp) dot += p[j] * d[j];
  dot = warp_sum(dot);
  for (int j = lane; j <= t; j += kWarp) d[j] = p[j] * (d[j] - dot);
  for (int j = t + 1 + lane; j < seq; j += kWarp) d[j] = 0.0f;
}

// ---- embedding ----

__global__ void embedding_forward_kernel(const int32_t* tokens, const float* wte, const float* wpe,
                                         int64_t rows, int seq, int dim, float* x) {
  const int64_t i = global_index();
  if (i >= rows * dim) return;
  const int64_t r = i / dim;
  const int c = static_cast<int>(i % dim);
  x[i] = wte[int64_t{tokens[r]} * dim + c] + wpe[(r % seq) * dim + c];
}

// One thread per column, the rows in order: rows sharing a token (or a position) add into the same
// gradient row without a race, and in the CPU's order.
__global__ void embedding_backward_kernel(const float* dx, const int32_t* tokens, int64_t rows,
                                          int seq, int dim, float* dwte, float* dwpe) {
  const int64_t c = global_index();
  if (c >= dim) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float d = dx[r * dim + c];
    dwte[int64_t{tokens[r]} * dim + c] += d;
    dwpe[(r % seq) * dim + c] += d;
  }
}

// ---- cross-entropy: one block per row ----

__global__ void crossentropy_kernel(const float* logits, const int32_t* targets, int vocab, float k,
                                    float* dlogits, double* row_loss) {
  __shared__ float max_part[kThreads];
  __shared__ double sum_part[kThreads];
  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const float* lr = logits + r * vocab;
  float mx = -INFINITY;
  for (int j = tid; j < vocab; j += kThreads) mx = fmaxf(mx, lr[j]);
  max_part[tid] = mx;
  __syncthreads();
  for (int s = kThreads / 2; s >= 1; s /= 2) {
    if (tid < s) max_part[tid] = fmaxf(max_part[tid], max_part[tid + s]);
    __syncthreads();
  }
  mx = max_part[0];
  double sum = 0.0;
  for (int j = tid; j < vocab; j += kThreads) sum += exp(static_cast<double>(lr[j] - mx));
  sum_part[tid] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s >= 1; s /= 2) {
    if (tid < s) sum_part[tid] += sum_part[tid + s];
    __syncthreads();
  }
  const double lse = mx + log(sum_part[0]);
  const int32_t target = targets[r];
  if (tid == 0) row_loss[r] = lse - lr[target];
  if (dlogits == nullptr) return;
  __syncthreads();  // every read of lr above happens before dlogits (which may be lr) is written
  float* dr = dlogits + r * vocab;
  for (int j = tid; j < vocab; j += kThreads) {
    const float prob = static_cast<float>(exp(lr[j] - lse));
    dr[j] = k * (prob - (j == target ? 1.0f : 0.0f));
  }
}

}  // namespace

// ---- Gpu ----

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error: no driver or no device is not a failure here
    return 0;
  }
  return count;
}

std::unique_ptr<Gpu> Gpu::create(int ordinal, std::string* error) {
  const int gpus = device_count();
  if (gpus == 0) {
    *error = "no CUDA device is visible (no GPU, or no driver)";
    return nullptr;
  }
  if (ordinal < 0 || ordinal >= gpus) {
    *error = "GPU " + std::to_string(ordinal) + " asked for; " + std::to_string(gpus) + " visible";
    return nullptr;
  }
  auto impl = std::make_unique<Impl>();
  impl->ordinal = ordinal;
  impl->api = load_blas(error);
  if (impl->api == nullptr) return nullptr;
  cudaError_t err = cudaSetDevice(ordinal);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    *error = std::string("cudaStreamCreate: ") + cudaGetErrorString(err);
    return nullptr;
  }
  cublasStatus_t st = impl->api->create(&impl->blas);
  if (st == CUBLAS_STATUS_SUCCESS) st = impl->api->set_stream(impl->blas, impl->stream);
  // Plain fp32 products: no TF32 (CUBLAS_DEFAULT_MATH; NVIDIA_TF32_OVERRIDE=1 could still force
  // it, which the layers' stated bounds do not cover).
  if (st == CUBLAS_STATUS_SUCCESS) st = impl->api->set_math_mode(impl->blas, CUBLAS_DEFAULT_MATH);
  if (st != CUBLAS_STATUS_SUCCESS) {
    *error = "cublasCreate: cuBLAS status " + std::to_string(static_cast<int>(st));
    if (impl->blas != nullptr) impl->api->destroy(impl->blas);
    cudaStreamDestroy(impl->stream);
    return nullptr;
  }
  return std::unique_ptr<Gpu>(new Gpu(std::move(impl)));
}

Gpu::Gpu(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Gpu::Impl& Gpu::impl() {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != impl_->ordinal) {
    impl_->ok(cudaSetDevice(impl_->ordinal), "cudaSetDevice");
  }
  return *impl_;
}

Gpu::~Gpu() {
  (void)impl();
  if (impl_->att_scratch != nullptr) cudaFreeAsync(impl_->att_scratch, impl_->stream);
  if (impl_->row_loss != nullptr) cudaFreeAsync(impl_->row_loss, impl_->stream);
  for (uint16_t* h : impl_->half) {
    if (h != nullptr) cudaFreeAsync(h, impl_->stream);
  }
  cudaStreamSynchronize(impl_->stream);
  impl_->api->destroy(impl_->blas);
  cudaStreamDestroy(impl_->stream);
}

void* Gpu::stream() const { return impl_->stream; }

void Gpu::set_matmul_inputs(DType dtype) { impl_->matmul_inputs = dtype; }
DType Gpu::matmul_inputs() const { return impl_->matmul_inputs; }

std::string Gpu::error() {
  (void)impl();
  impl_->launched("an earlier kernel");
  std::string e = std::move(impl_->error);
  impl_->error.clear();
  return e;
}

std::string Gpu::synchronize() {
  (void)impl();
  impl_->ok(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
  return error();
}

void* Gpu::alloc(size_t bytes) {
  (void)impl();
  void* p = nullptr;
  if (impl_->failed()) return nullptr;
  if (!impl_->ok(cudaMallocAsync(&p, bytes, impl_->stream), "cudaMallocAsync")) return nullptr;
  return p;
}

void Gpu::free(void* p) {
  (void)impl();
  if (p != nullptr) cudaFreeAsync(p, impl_->stream);
}

void Gpu::to_device(void* dst, const void* host, size_t bytes) {
  (void)impl();
  if (impl_->failed() || bytes == 0) return;
  impl_->ok(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, impl_->stream),
            "copy to the device");
}

void Gpu::to_host(void* host, const void* src, size_t bytes) {
  (void)impl();
  if (impl_->failed() || bytes == 0) return;
  impl_->ok(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, impl_->stream),
            "copy to the host");
}

void Gpu::zero(void* dst, size_t bytes) {
  (void)impl();
  if (impl_->failed() || bytes == 0) return;
  impl_->ok(cudaMemsetAsync(dst, 0, bytes, impl_->stream), "cudaMemsetAsync");
}

// ---- layers ----

namespace {

// One product of gemm_plan.h on the stream.
void run(Gpu::Impl& g, const GemmCall& c) {
  if (g.failed()) return;
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (c.m > kMax || c.n > kMax || c.k > kMax || c.lda > kMax || c.ldb > kMax || c.ldc > kMax) {
    g.fail("matrix product " + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" +
           std::to_string(c.k) + " exceeds cuBLAS's 32-bit sizes");
    return;
  }
  const cublasOperation_t op_a = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const auto m = static_cast<int>(c.m), n = static_cast<int>(c.n), k = static_cast<int>(c.k);
  const auto lda = static_cast<int>(c.lda), ldb = static_cast<int>(c.ldb);
  const auto ldc = static_cast<int>(c.ldc);
  if (c.count == 1) {
    g.ok(g.api->sgemm(g.blas, op_a, op_b, m, n, k, &c.alpha, c.a, lda, c.b, ldb, &c.beta, c.c, ldc),
         "cublasSgemm");
  } else {
    g.ok(g.api->sgemm_strided_batched(g.blas, op_a, op_b, m, n, k, &c.alpha, c.a, lda, c.stride_a,
                                      c.b, ldb, c.stride_b, &c.beta, c.c, ldc, c.stride_c, c.count),
         "cublasSgemmStridedBatched");
  }
}

// `n` fp32 values rounded into 16-bit copy `slot`; null (the failure recorded) when it fails.
const float* rounded_copy(Gpu::Impl& g, int slot, const float* x, int64_t n) {
  uint16_t* y =
      g.scratch(g.half[slot], g.half_elems[slot], static_cast<size_t>(n), "16-bit product operand");
  if (y == nullptr) return nullptr;
  round_to_16bit_kernel<<<blocks_for(n), kThreads, 0, g.stream>>>(
      x, n, g.matmul_inputs == DType::kBF16, y);
  if (!g.launched("rounding a product operand to 16 bits")) return nullptr;
  // Handed through GemmCall's pointers, which only carry the address: run16 reads it as 16-bit.
  return reinterpret_cast<const float*>(y);
}

// A product of gemm_plan.h whose A and B point at 16-bit copies (rounded_copy), C at fp32:
// tensor cores, fp32 accumulation.
void run16(Gpu::Impl& g, const GemmCall& c) {
  if (g.failed()) return;
  const cudaDataType_t in = g.matmul_inputs == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  g.ok(g.api->gemm_ex(g.blas, c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                      c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(c.m),
                      static_cast<int>(c.n), static_cast<int>(c.k), &c.alpha, c.a, in,
                      static_cast<int>(c.lda), c.b, in, static_cast<int>(c.ldb), &c.beta, c.c,
                      CUDA_R_32F, static_cast<int>(c.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
       "cublasGemmEx");
}

// The rows of a linear layer's product within cuBLAS's int (run() checks the fp32 calls).
bool rows_fit_cublas(Gpu::Impl& g, int64_t rows) {
  if (rows <= std::numeric_limits<int>::max()) return true;
  g.fail("matrix product with " + std::to_string(rows) + " rows exceeds cuBLAS's 32-bit sizes");
  return false;
}

}  // namespace

void layernorm_forward(Gpu& gpu, const float* x, const float* w, const float* b, int64_t rows,
                       int dim, float* y, float* mean, float* rstd) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || rows == 0) return;
  layernorm_forward_kernel<<<blocks_for(rows * kWarp), kThreads, 0, g.stream>>>(x, w, b, rows, dim,
                                                                                y, mean, rstd);
  g.launched("layernorm_forward");
}

void layernorm_backward(Gpu& gpu, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t rows, int dim, float* dx,
                        float* dw, float* db) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || rows == 0) return;
  layernorm_backward_dx_kernel<<<blocks_for(rows * kWarp), kThreads, 0, g.stream>>>(
      dy, x, w, mean, rstd, rows, dim, dx);
  if (!g.launched("layernorm_backward (dx)")) return;
  layernorm_backward_params_kernel<<<blocks_for(dim), kThreads, 0, g.stream>>>(dy, x, mean, rstd,
                                                                               rows, dim, dw, db);
  g.launched("layernorm_backward (dw, db)");
}

void matmul_forward(Gpu& gpu, const float* x, const float* w, const float* b, int64_t rows, int in,
                    int out, float* y) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || rows == 0) return;
  float beta = 0.0f;
  if (b != nullptr) {
    broadcast_rows_kernel<<<blocks_for(rows * out), kThreads, 0, g.stream>>>(b, rows, out, y);
    if (!g.launched("matmul_forward (bias)")) return;
    beta = 1.0f;
  }
  if (g.matmul_inputs == DType::kF32) {
    run(g, matmul_forward_gemm(x, w, rows, in, out, beta, y));
    return;
  }
  if (!rows_fit_cublas(g, rows)) return;
  const float* x16 = rounded_copy(g, 0, x, rows * in);
  const float* w16 = rounded_copy(g, 1, w, int64_t{out} * in);
  if (x16 != nullptr && w16 != nullptr)
    run16(g, matmul_forward_gemm(x16, w16, rows, in, out, beta, y));
}

void matmul_backward(Gpu& gpu, const float* dy, const float* x, const float* w, int64_t rows,
                     int in, int out, float* dx, float* dw, float* db) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || rows == 0) return;
  if (g.matmul_inputs == DType::kF32) {
    if (dx != nullptr) run(g, matmul_dx_gemm(dy, w, rows, in, out, dx));
    run(g, matmul_dw_gemm(dy, x, rows, in, out, dw));
  } else if (rows_fit_cublas(g, rows)) {
    // dy rounded once for both products; slot 1 holds w, then x (stream order keeps them apart).
    const float* dy16 = rounded_copy(g, 0, dy, rows * out);
    if (dx != nullptr) {
      const float* w16 = rounded_copy(g, 1, w, int64_t{out} * in);
      if (dy16 != nullptr && w16 != nullptr) run16(g, matmul_dx_gemm(dy16, w16, rows, in, out, dx));
    }
    const float* x16 = rounded_copy(g, 1, x, rows * in);
    if (dy16 != nullptr && x16 != nullptr) run16(g, matmul_dw_gemm(dy16, x16, rows, in, out, dw));
  }
  if (db != nullptr && !g.failed()) {
    column_sums_add_kernel<<<blocks_for(out), kThreads, 0, g.stream>>>(dy, rows, out, db);
    g.launched("matmul_backward (db)");
  }
}

void gelu_forward(Gpu& gpu, const float* x, int64_t n, float* y) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || n == 0) return;
  gelu_forward_kernel<<<blocks_for(n), kThreads, 0, g.stream>>>(x, n, y);
  g.launched("gelu_forward");
}

void gelu_backward(Gpu& gpu, const float* dy, const float* x, int64_t n, float* dx) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || n == 0) return;
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, g.stream>>>(dy, x, n, dx);
  g.launched("gelu_backward");
}

void attention_forward(Gpu& gpu, const float* qkv, int batch, int seq, int dim, int heads,
                       float* att, float* y) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || batch == 0) return;
  const AttentionShape shape{.batch = batch, .seq = seq, .dim = dim, .heads = heads};
  const float scale = 1.0f / sqrtf(static_cast<float>(shape.hd()));
  for (int b = 0; b < batch; ++b) run(g, attention_scores_gemm(shape, qkv, b, scale, att));
  if (g.failed()) return;
  const int64_t matrices = int64_t{batch} * heads;
  causal_softmax_kernel<<<blocks_for(matrices * seq * kWarp), kThreads, 0, g.stream>>>(
      att, matrices, seq);
  if (!g.launched("attention_forward (softmax)")) return;
  for (int b = 0; b < batch; ++b) run(g, attention_values_gemm(shape, qkv, att, b, y));
}

void attention_backward(Gpu& gpu, const float* dy, const float* qkv, const float* att, int batch,
                        int seq, int dim, int heads, float* dqkv) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || batch == 0) return;
  const AttentionShape shape{.batch = batch, .seq = seq, .dim = dim, .heads = heads};
  const float scale = 1.0f / sqrtf(static_cast<float>(shape.hd()));
  float* ds = g.scratch(g.att_scratch, g.att_scratch_elems, static_cast<size_t>(heads * shape.tt()),
                        "attention_backward scratch");
  if (ds == nullptr) return;
  for (int b = 0; b < batch; ++b) {
    run(g, attention_dp_gemm(shape, dy, qkv, b, ds));
    run(g, attention_dv_gemm(shape, att, dy, b, dqkv));
    if (g.failed()) return;
    softmax_backward_kernel<<<blocks_for(int64_t{heads} * seq * kWarp), kThreads, 0, g.stream>>>(
        att + int64_t{b} * heads * shape.tt(), heads, seq, ds);
    if (!g.launched("attention_backward (softmax)")) return;
    run(g, attention_dq_gemm(shape, ds, qkv, b, scale, dqkv));
    run(g, attention_dk_gemm(shape, ds, qkv, b, scale, dqkv));
  }
}

void embedding_forward(Gpu& gpu, const int32_t* tokens, const float* wte, const float* wpe,
                       int batch, int seq, int dim, float* x) {
  Gpu::Impl& g = gpu.impl();
  const int64_t rows = int64_t{batch} * seq;
  if (g.failed() || rows == 0) return;
  embedding_forward_kernel<<<blocks_for(rows * dim), kThreads, 0, g.stream>>>(tokens, wte, wpe,
                                                                              rows, seq, dim, x);
  g.launched("embedding_forward");
}

void embedding_backward(Gpu& gpu, const float* dx, const int32_t* tokens, int batch, int seq,
                        int dim, float* dwte, float* dwpe) {
  Gpu::Impl& g = gpu.impl();
  const int64_t rows = int64_t{batch} * seq;
  if (g.failed() || rows == 0) return;
  embedding_backward_kernel<<<blocks_for(dim), kThreads, 0, g.stream>>>(dx, tokens, rows, seq, dim,
                                                                        dwte, dwpe);
  g.launched("embedding_backward");
}

double crossentropy_forward_backward(Gpu& gpu, const float* logits, const int32_t* targets,
                                     int64_t rows, int vocab, float loss_scale, float* dlogits) {
  Gpu::Impl& g = gpu.impl();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (g.failed() || rows == 0) return nan;
  double* row_loss =
      g.scratch(g.row_loss, g.row_loss_elems, static_cast<size_t>(rows), "crossentropy scratch");
  if (row_loss == nullptr) return nan;
  const float k = loss_scale / static_cast<float>(rows);
  crossentropy_kernel<<<static_cast<unsigned>(rows), kThreads, 0, g.stream>>>(
      logits, targets, vocab, k, dlogits, row_loss);
  if (!g.launched("crossentropy")) return nan;
  std::vector<double> host(static_cast<size_t>(rows));
  gpu.to_host(host.data(), row_loss, host.size() * sizeof(double));
  // The error stays recorded for the caller's error().
  if (!g.ok(cudaStreamSynchronize(g.stream), "crossentropy") || g.failed()) return nan;
  double total = 0.0;  // in row order, as the CPU sums
  for (double l : host) total += l;
  return total / static_cast<double>(rows);
}

void add(Gpu& gpu, const float* a, const float* b, int64_t n, float* out) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, g.stream>>>(a, b, n, out);
  g.launched("add");
}

void copy(Gpu& gpu, const float* src, int64_t n, float* dst) {
  Gpu::Impl& g = gpu.impl();
  if (g.failed() || n == 0 || src == dst) return;
  g.ok(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                       g.stream),
       "device copy");
}

}  // namespace zinf::gpt::cuda
