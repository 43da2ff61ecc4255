// The GPT on a CUDA GPU: Model (model.h) with every unit's forward and backward run by the layers
// of cuda_layers.h, activations in device memory. Same call sequence and callbacks as Model, so a
// driver (the trainer, a test) swaps one for the other; the callbacks return DEVICE pointers to
// the unit's fp32 parameters and gradient buffers.
//
// The stream is synchronized before each callback call: a unit's buffers are used only until the
// next call (Model's contract), so a driver may release them then.
#pragma once

#include <cstdint>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/cuda_layers.h"
#include "zinf/gpt/model.h"

namespace zinf::gpt::cuda {

class GpuModel {
 public:
  GpuModel(const GptConfig& cfg, Gpu& gpu);  // cfg must pass validate()

  // Model::forward_backward on the GPU. tokens and targets are host arrays [B, T]; an id outside
  // [0, vocab) is an error, as is any CUDA or cuBLAS failure (named).
  Result<double> forward_backward(const UnitParamsFn& params, const UnitGradsFn& grads,
                                  const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                  float loss_scale = 1.0f);
  // The mean loss, no backward.
  Result<double> forward_loss(const UnitParamsFn& params, const int32_t* tokens,
                              const int32_t* targets, int batch, int seq);

  // Bytes of device memory held for activations and scratch.
  int64_t activation_bytes() const;

 private:
  struct Block {  // BlockActivations in device memory
    DeviceArray<float> x_in, ln1_mean, ln1_rstd, ln1_out, qkv, att, att_y, x_mid, ln2_mean,
        ln2_rstd, ln2_out, fc_pre, fc_act;
  };

  Status upload(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  Status forward(const UnitParamsFn& params, int batch, int seq);
  void block_forward(const float* params, float* x, int batch, int seq, Block& a);
  void block_backward(const float* params, const Block& a, float* dx, float* grads, int batch,
                      int seq);
  // Waits for the stream; the error (if any) named with `where`.
  Status sync(std::string_view where);

  GptConfig cfg_;
  Gpu& gpu_;
  DeviceArray<int32_t> tokens_, targets_;
  DeviceArray<float> x_, dx_;
  std::vector<Block> blocks_;
  DeviceArray<float> d_fc_, d_ln_, d_mid_, d_att_y_, d_qkv_;  // BlockWorkspace
  DeviceArray<float> lnf_x_, lnf_mean_, lnf_rstd_, lnf_out_;  // FinalNormActivations
  DeviceArray<float> logits_, dh_;                            // HeadWorkspace
};

}  // namespace zinf::gpt::cuda
