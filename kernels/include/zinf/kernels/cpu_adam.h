// CPU Adam/AdamW at memory speed, and the helpers the optimizer driver needs around it
// (gradient sum of squares for global-norm clipping, inf/NaN detection, scaling, dtype casts).
//
// Every function here:
//  - runs on `threads` threads of a oneTBB arena (0 = all the process may use, as do counts above
//    that; 1 = the calling thread only, no TBB), over fixed chunks of kCpuChunkElems elements;
//  - uses the SIMD path `isa` (kAuto = best_isa(): AVX-512 where the CPU has it, else AVX2 + FMA +
//    F16C, else scalar), chosen at run time; asking for an unsupported path is a broken invariant;
//  - gives the same bits for every thread count, every SIMD path and every start address or
//    offset: elementwise results never depend on where an element sits (the SIMD loops evaluate
//    adam_math.h's adam_update() lane by lane, and their tails run the scalar instantiation), and
//    reductions use a chunking fixed by the element index, never by the thread count;
//  - accepts any alignment and n = 0. Input and output arrays must not overlap, except where an
//    argument is documented as in-place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/core/dtype.h"
#include "zinf/kernels/adam_math.h"
#include "zinf/kernels/cpu_features.h"

namespace zinf::kernels {

// Parallel work unit of every function below (elements). 32 K elements: 128 KiB of each fp32
// stream, small enough for load balance, large enough that scheduling costs nothing.
inline constexpr size_t kCpuChunkElems = 32768;

// Threads a call with `threads` uses: oneTBB's default concurrency for this process (its CPU
// affinity) when threads is 0 or more than that, else threads.
int resolve_threads(int threads);

// The arrays of one Adam step over n elements. All fp32 arrays are updated in place.
struct AdamTensors {
  float* param = nullptr;          // fp32 parameters (the master copy in mixed precision)
  float* m = nullptr;              // first moment
  float* v = nullptr;              // second moment
  const void* grad = nullptr;      // gradients, read only
  DType grad_dtype = DType::kF32;  // fp32, bf16 or fp16
  void* param_copy = nullptr;      // optional: the updated params converted to copy_dtype, written
                                   // in the same pass (the bf16/fp16 working copy), or nullptr
  DType copy_dtype = DType::kBF16;
  size_t n = 0;
};

struct AdamStats {
  // Some scaled gradient (grad * grad_scale) was inf or NaN.
  bool found_nonfinite_grad = false;
};

// One Adam/AdamW step: for every element, adam_element() of adam_math.h (bit for bit), then
// param_copy[i] = round_to_nearest_even(param[i]) when a copy is asked for.
//
// Non-finite gradients: the step is one pass that updates in place, so it cannot be undone once a
// bad gradient is found. adam_step applies the update regardless (NaN/inf then reach the affected
// elements) and reports it in AdamStats. A driver that must skip the step (fp16 loss scaling)
// checks first with grad_sum_squares() (its result is non-finite iff some gradient is: the same
// pass also gives the global norm for clipping) or grad_has_nonfinite(), then calls adam_step
// only for finite gradients. Requires args.step >= 1 when cfg.bias_correction.
AdamStats adam_step(const AdamConfig& cfg, const AdamStepArgs& args, const AdamTensors& t,
                    int threads = 0, Isa isa = Isa::kAuto);

// Bytes one adam_step over t moves through memory: reads param, grad, m, v; writes param, m, v
// and the copy (fp32 everywhere: 28 per element).
size_t adam_step_bytes(const AdamTensors& t);

// The memory-bandwidth yardstick of adam_step: reads and writes exactly the arrays adam_step does
// (same streams, same chunks, same threads) with trivial arithmetic (x = x + 0 * grad; the copy
// gets the top 16 bits of the param). For finite inputs it leaves param, m and v unchanged and
// overwrites param_copy. `zinf bench adam` reports adam_step's time relative to it.
void adam_traffic_roofline(const AdamTensors& t, int threads = 0, Isa isa = Isa::kAuto);

// ---- gradient norm and inf/NaN ---------------------------------------------------------------

// Sum over i of (double(grad[i]) * double(scale))^2, deterministic: the elements are cut into
// blocks of kSumSquaresBlockElems counted from grad[0]; element i of a block is accumulated into
// lane i % 16 with a double FMA (the product and each lane's order are fixed), a block's 16 lanes
// are added as a fixed tree, and the blocks are added in order, left to right. The result is
// therefore the same for every thread count and SIMD path. It is inf or NaN iff some grad is
// (for a finite non-zero scale), so it doubles as the overflow check of loss scaling.
inline constexpr size_t kSumSquaresBlockElems = 1024;
double grad_sum_squares(const void* grad, DType dtype, size_t n, float scale = 1.0f,
                        int threads = 0, Isa isa = Isa::kAuto);

// The per-block partial sums behind grad_sum_squares (ceil(n / kSumSquaresBlockElems) doubles
// into block_sums). Adding them left to right gives grad_sum_squares() bit for bit. A driver that
// wants a global norm independent of how a tensor is sharded can cut shards at multiples of
// kSumSquaresBlockElems and add the gathered block sums in global order.
size_t sum_squares_block_count(size_t n);
void grad_sum_squares_blocks(const void* grad, DType dtype, size_t n, float scale,
                             double* block_sums, int threads = 0, Isa isa = Isa::kAuto);

// Whether some element is inf or NaN. Cheaper than grad_sum_squares when the norm is not needed.
bool grad_has_nonfinite(const void* grad, DType dtype, size_t n, int threads = 0,
                        Isa isa = Isa::kAuto);

// ---- scaling and casts -------------------------------------------------------------------------

// In place: x[i] = x[i] * scale, computed in fp32 (bf16/fp16 values are widened exactly, then the
// product is rounded back to nearest even, as f32_to_bf16/f32_to_f16 of zinf/core/dtype.h).
void scale_inplace(void* data, DType dtype, size_t n, float scale, int threads = 0,
                   Isa isa = Isa::kAuto);

// dst[i] = src[i] converted, bit for bit as the scalar conversions of zinf/core/dtype.h:
// narrowing rounds to nearest even, overflows to inf, keeps NaN a (quiet) NaN; widening is exact
// (fp16 signalling NaNs stay signalling, as f16_to_f32 does); bf16 <-> fp16 goes through fp32
// (exact widening, one rounding). Same dtypes: a copy.
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n, int threads = 0,
          Isa isa = Isa::kAuto);

// acc[i] += (float)src[i] for an fp32, bf16 or fp16 source, in element order (the gradient
// accumulation of micro-steps). With `overwrite`, acc[i] = 0.0f + (float)src[i] without reading
// acc: the same bits as adding into a zeroed accumulator (-0 becomes +0), so a lazily zeroed
// accumulator need not be written first.
void accumulate(float* acc, const void* src, DType src_dtype, size_t n, bool overwrite,
                int threads = 0);

}  // namespace zinf::kernels
