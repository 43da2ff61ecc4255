// The whole GPT without the Engine: runs the units of units.h in order, asking a callback for each
// unit's parameters and gradient buffers. Tests and a single-process trainer use it directly; the
// Engine-driven trainer follows the same sequence with gather() in place of the callbacks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/gpt/config.h"
#include "zinf/gpt/units.h"

namespace zinf::gpt {

// Unit u's flat parameter buffer. The pointer is used only until the next call of the callback.
using UnitParamsFn = std::function<const float*(int unit)>;
// Unit u's flat gradient buffer (accumulated into). Used only until the next call.
using UnitGradsFn = std::function<float*(int unit)>;

class Model {
 public:
  explicit Model(const GptConfig& cfg);  // cfg must pass validate()

  // One micro-step: forward, loss, backward; gradients accumulate. tokens and targets are
  // [B, T], T <= cfg.seq. Callback order: params 0, 1..L, L+1, 0 (head); grads 0 (head); params
  // L+1, grads L+1; params L..1 with grads L..1; grads 0 (embedding). Returns the mean loss.
  double forward_backward(const UnitParamsFn& params, const UnitGradsFn& grads,
                          const int32_t* tokens, const int32_t* targets, int batch, int seq,
                          float loss_scale = 1.0f);
  // The mean loss, no backward.
  double forward_loss(const UnitParamsFn& params, const int32_t* tokens, const int32_t* targets,
                      int batch, int seq);
  // logits [B, T, V].
  void forward_logits(const UnitParamsFn& params, const int32_t* tokens, int batch, int seq,
                      float* logits);

  const GptConfig& config() const { return cfg_; }
  // Bytes of activations and scratch currently held.
  int64_t activation_bytes() const;

 private:
  void forward(const UnitParamsFn& params, const int32_t* tokens, int batch, int seq);

  GptConfig cfg_;
  std::vector<float> x_;   // residual stream [B,T,D]
  std::vector<float> dx_;  // its gradient
  std::vector<BlockActivations> blocks_;
  BlockWorkspace block_ws_;
  FinalNormActivations final_norm_;
  HeadWorkspace head_ws_;
};

// One-shot forms of Model's methods (allocate the activations each call).
double model_forward_backward(const GptConfig& cfg, const UnitParamsFn& params,
                              const UnitGradsFn& grads, const int32_t* tokens,
                              const int32_t* targets, int batch, int seq, float loss_scale = 1.0f);
double model_forward_loss(const GptConfig& cfg, const UnitParamsFn& params, const int32_t* tokens,
                          const int32_t* targets, int batch, int seq);

// Every unit's parameters and gradients in process memory: what the Engine holds in shards, for
// tests and single-process runs.
class LocalParams {
 public:
  explicit LocalParams(const GptConfig& cfg);

  // Every element from init_value(), unit index as the salt: the values the Engine produces.
  void init(uint64_t seed);
  void zero_grads();

  int num_units() const { return static_cast<int>(params_.size()); }
  std::vector<float>& params(int unit) { return params_[unit]; }
  std::vector<float>& grads(int unit) { return grads_[unit]; }
  UnitParamsFn params_fn();
  UnitGradsFn grads_fn();

 private:
  GptConfig cfg_;
  std::vector<std::vector<float>> params_;
  std::vector<std::vector<float>> grads_;
};

enum class Sampling {
  kRandom,  // draw from softmax(logits / temperature), restricted to the top_k most likely
  kGreedy,  // the most likely byte (lowest on ties)
};

struct SampleOptions {
  Sampling sampling = Sampling::kRandom;
  float temperature = 1.0f;  // > 0
  int top_k = 0;             // 0: the whole vocabulary
  uint64_t seed = 0;         // the same seed and prompt give the same text
};

// Continues `prompt` by `num_bytes` bytes, conditioning on the last cfg.seq tokens at each step
// (no key/value cache: a full forward per byte). An empty prompt starts from "\n". Needs
// vocab <= 256; errors on bad options or prompt bytes outside the vocabulary.
Result<std::string> generate(const GptConfig& cfg, const UnitParamsFn& params,
                             std::string_view prompt, int num_bytes, const SampleOptions& options);

}  // namespace zinf::gpt
