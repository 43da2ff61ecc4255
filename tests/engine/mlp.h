// A small MLP trained through the Engine: the test vehicle for stage equivalence. Units of
// uneven sizes (Linear + tanh, the last one linear), a mean-squared-error loss, data that is a
// pure function of the global sample index. Works in fp32, bf16 and fp16 working precision
// (computes in fp32 on the host, converts at the unit boundary through the device's operations,
// so it runs on the strict device too).
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "zinf/comm/local.h"
#include "zinf/engine/engine.h"

namespace zinf::testing {

struct MlpShape {
  std::vector<int> dims = {13, 40, 27, 5};  // units: 13->40, 40->27, 27->5
};

inline std::vector<zero::UnitSpec> mlp_units(const MlpShape& shape) {
  std::vector<zero::UnitSpec> units;
  for (size_t i = 0; i + 1 < shape.dims.size(); ++i) {
    units.push_back(
        {.name = "layer" + std::to_string(i),
         .params = {{.name = "w", .shape = {shape.dims[i + 1], shape.dims[i]}},
                    {.name = "b", .shape = {shape.dims[i + 1]}, .weight_decay = false}}});
  }
  return units;
}

inline float mlp_init(size_t unit, uint64_t element, uint64_t seed) {
  uint64_t z = (seed + 1) * 0x9e3779b97f4a7c15ull ^ (unit << 40) ^ element;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 29;
  return static_cast<float>(static_cast<double>(z % 20001) / 10000.0 - 1.0) * 0.4f;
}

inline void sample(uint64_t index, const MlpShape& shape, std::vector<float>& x,
                   std::vector<float>& y) {
  x.resize(shape.dims.front());
  y.resize(shape.dims.back());
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * index + 1.3f * i);
  for (size_t i = 0; i < y.size(); ++i) y[i] = std::cos(0.21f * index * (i + 1));
}

// A unit's fp32 parameters: in the device's memory where asked for and lent, else copied into
// `copy`.
inline Result<const float*> unit_params(UnitScope& scope, bool in_place, std::vector<float>& copy) {
  if (in_place) {
    ZINF_ASSIGN_OR_RETURN(const float* p, scope.params_in_place());
    if (p != nullptr) return p;
  }
  copy.resize(scope.layout().numel);
  ZINF_RETURN_IF_ERROR(scope.params_to_host(copy));
  return static_cast<const float*>(copy.data());
}

// One micro-step on `samples` (global sample indices) through the engine; returns the mean loss.
// `loss_scale` multiplies the gradients (fp16 loss scaling). `in_place`: read the parameters and
// write the gradients in the device's memory where the engine lends it (params_in_place,
// grads_in_place), as the GPT's CPU model does; the copies where it declines.
inline Result<float> mlp_micro_step(Engine& engine, const MlpShape& shape,
                                    const std::vector<uint64_t>& samples, bool in_place = false) {
  const size_t L = shape.dims.size() - 1;
  const float scale = engine.loss_scale();
  std::vector<std::vector<std::vector<float>>> acts(samples.size());  // [sample][layer] inputs
  std::vector<std::vector<float>> outs(samples.size());
  std::vector<std::vector<float>> targets(samples.size());
  for (size_t s = 0; s < samples.size(); ++s) {
    std::vector<float> x;
    sample(samples[s], shape, x, targets[s]);
    acts[s].push_back(x);
  }
  for (size_t u = 0; u < L; ++u) {
    ZINF_ASSIGN_OR_RETURN(UnitScope scope, engine.gather(u));
    const int in = shape.dims[u], out = shape.dims[u + 1];
    std::vector<float> copy;
    ZINF_ASSIGN_OR_RETURN(const float* p, unit_params(scope, in_place, copy));
    for (size_t s = 0; s < samples.size(); ++s) {
      std::vector<float> y(out);
      for (int o = 0; o < out; ++o) {
        float acc = p[static_cast<uint64_t>(out) * in + o];
        for (int i = 0; i < in; ++i) acc += p[static_cast<uint64_t>(o) * in + i] * acts[s][u][i];
        y[o] = u + 1 < L ? std::tanh(acc) : acc;
      }
      if (u + 1 < L) {
        acts[s].push_back(y);
      } else {
        outs[s] = y;
      }
    }
  }
  // Loss = mean over samples of 0.5 * sum (y - t)^2.
  double loss = 0;
  std::vector<std::vector<float>> dy(samples.size());
  const float inv_n = 1.0f / static_cast<float>(samples.size());
  for (size_t s = 0; s < samples.size(); ++s) {
    dy[s].resize(outs[s].size());
    for (size_t o = 0; o < outs[s].size(); ++o) {
      float d = outs[s][o] - targets[s][o];
      loss += 0.5 * d * d;
      dy[s][o] = d * inv_n * scale;
    }
  }
  for (size_t u = L; u-- > 0;) {
    ZINF_ASSIGN_OR_RETURN(UnitScope scope, engine.gather(u));
    const int in = shape.dims[u], out = shape.dims[u + 1];
    std::vector<float> copy;
    ZINF_ASSIGN_OR_RETURN(const float* p, unit_params(scope, in_place, copy));
    // Gradients of this micro-batch in fp32 first, then written once in the working dtype (as a
    // real backward writes its result into the buffer).
    std::vector<float> gw(static_cast<size_t>(out) * in + out, 0.0f);
    for (size_t s = 0; s < samples.size(); ++s) {
      std::vector<float> dz = dy[s];
      if (u + 1 < L) {  // through tanh: the stored output of layer u is acts[s][u+1]
        for (int o = 0; o < out; ++o) dz[o] *= 1.0f - acts[s][u + 1][o] * acts[s][u + 1][o];
      }
      std::vector<float> dx(in, 0.0f);
      for (int o = 0; o < out; ++o) {
        for (int i = 0; i < in; ++i) {
          gw[static_cast<size_t>(o) * in + i] += dz[o] * acts[s][u][i];
          dx[i] += p[static_cast<uint64_t>(o) * in + i] * dz[o];
        }
        gw[static_cast<size_t>(out) * in + o] += dz[o];
      }
      dy[s] = dx;
    }
    float* g = nullptr;
    if (in_place) {
      ZINF_ASSIGN_OR_RETURN(g, scope.grads_in_place());
    }
    if (g != nullptr) {
      for (size_t i = 0; i < gw.size(); ++i) g[i] += gw[i];  // onto the zeroed buffer
    } else {
      ZINF_RETURN_IF_ERROR(scope.grads_from_host(gw));
    }
    ZINF_RETURN_IF_ERROR(scope.finish());
  }
  return static_cast<float>(loss / samples.size());
}

struct RunResult {
  std::vector<std::vector<float>> params;  // per unit, from rank 0
  std::vector<float> losses;               // rank 0's mean loss per step
  std::vector<MemoryReport> memory;        // per rank, after the last step
  std::vector<CommReport> comm;            // per rank, of the last step
  std::vector<ScheduleReport> schedule;    // per rank, of the last step
  std::vector<StepInfo> info;              // rank 0, per step
  Status status;
};

// Whether two runs ended on bit-identical parameters (every element of every unit).
inline bool same_bits(const std::vector<std::vector<float>>& a,
                      const std::vector<std::vector<float>>& b) {
  if (a.empty() || a.size() != b.size()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() || std::memcmp(a[u].data(), b[u].data(), a[u].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}
inline bool same_bits(const RunResult& a, const RunResult& b) {
  return same_bits(a.params, b.params);
}

// Trains `steps` steps on `world` local ranks: each step, each rank runs
// gradient_accumulation_steps micro-steps of `micro` samples.
inline RunResult train_local(EngineSettings settings, int world, int steps, int micro,
                             const MlpShape& shape = {},
                             std::function<void(Engine&, int step)> before_step = {},
                             bool in_place = false) {
  RunResult out;
  auto group = comm::make_local_group(world).value();
  std::vector<Status> status(world);
  out.memory.resize(world);
  out.comm.resize(world);
  out.schedule.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto engine = Engine::create(settings, *group[r], mlp_units(shape), mlp_init);
      if (!engine.is_ok()) {
        status[r] = engine.status();
        return;
      }
      const int gas = settings.gradient_accumulation_steps;
      for (int step = 0; step < steps; ++step) {
        float loss_sum = 0;
        for (int m = 0; m < gas; ++m) {
          std::vector<uint64_t> samples;
          for (int i = 0; i < micro; ++i) {
            // The same global batch of world * gas * micro samples every step (so the loss
            // must fall); rank r takes its contiguous part.
            samples.push_back((static_cast<uint64_t>(r) * gas + m) * micro + i);
          }
          auto loss = mlp_micro_step(**engine, shape, samples, in_place);
          if (!loss.is_ok()) {
            status[r] = loss.status();
            return;
          }
          loss_sum += *loss;
        }
        if (before_step) before_step(**engine, step);
        Status s = (*engine)->step();
        if (!s.is_ok()) {
          status[r] = s;
          return;
        }
        if (r == 0) {
          out.losses.push_back(loss_sum / gas);
          out.info.push_back((*engine)->last_step());
        }
      }
      out.memory[r] = (*engine)->memory_report();
      out.comm[r] = (*engine)->comm_report();
      out.schedule[r] = (*engine)->schedule_report();
      for (size_t u = 0; u < (*engine)->unit_count(); ++u) {
        auto p = (*engine)->full_parameters(u);
        if (!p.is_ok()) {
          status[r] = p.status();
          return;
        }
        if (r == 0) out.params.push_back(std::move(p).value());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& s : status) {
    if (!s.is_ok() && out.status.is_ok()) out.status = s;
  }
  return out;
}

}  // namespace zinf::testing
