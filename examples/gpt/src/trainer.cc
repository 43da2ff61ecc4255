#include "zinf/gpt/trainer.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <type_traits>

#include "zinf/ckpt/directory.h"
#include "zinf/ckpt/manifest.h"
#include "zinf/comm/factory.h"
#include "zinf/comm/local.h"
#include "zinf/core/units.h"
#include "zinf/gpt/data.h"
#include "zinf/gpt/model.h"
#include "zinf/gpt/params.h"
#if ZINF_GPT_CUDA
#include "zinf/gpt/gpu_model.h"
#endif

namespace zinf::gpt {
#if ZINF_GPT_TEST_GPU_MODEL
// Set by tests/gpt/train_gpu_path_test.cc (see test_gpu_model_on_any_device below).
std::atomic<bool> g_test_gpu_model{false};
#endif
namespace {

std::vector<zero::UnitSpec> engine_units(const GptConfig& cfg) {
  std::vector<zero::UnitSpec> units;
  for (int u = 0; u < cfg.num_units(); ++u) {
    zero::UnitSpec spec{.name = unit_name(cfg, u)};
    for (const ParamSpec& p : unit_params(unit_kind(cfg, u), cfg)) {
      spec.params.push_back({.name = p.name, .shape = p.shape, .weight_decay = p.weight_decay});
    }
    units.push_back(std::move(spec));
  }
  return units;
}

// The Engine's InitFn: the model's own initialiser, located by flat element index.
InitFn make_init(const GptConfig& cfg) {
  struct Entry {
    uint64_t offset;
    ParamSpec spec;
  };
  auto table = std::make_shared<std::vector<std::vector<Entry>>>();
  for (int u = 0; u < cfg.num_units(); ++u) {
    std::vector<Entry> entries;
    uint64_t offset = 0;
    for (const ParamSpec& p : unit_params(unit_kind(cfg, u), cfg)) {
      entries.push_back({offset, p});
      uint64_t n = 1;
      for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
      offset += n;
    }
    table->push_back(std::move(entries));
  }
  return [table](size_t unit, uint64_t element, uint64_t seed) {
    const auto& entries = (*table)[unit];
    auto it = std::upper_bound(entries.begin(), entries.end(), element,
                               [](uint64_t e, const Entry& x) { return e < x.offset; });
    --it;
    return init_value(it->spec, element - it->offset, seed, unit);
  };
}

// The Engine's InitFn from a safetensors file: element `element` of unit `unit` is read from the
// mapped file (widened to fp32; the engine casts to the working dtype, rounding to nearest even).
// Every parameter of the model must be in the file with its shape, and nothing else: an error
// lists what differs, naming the tensors and the file.
Result<InitFn> make_file_init(const GptConfig& cfg, const std::string& path) {
  auto opened = SafetensorsFile::open(path);
  if (!opened.is_ok()) return std::move(opened).take_status().with_context("--init-from");
  auto file = std::make_shared<const SafetensorsFile>(std::move(*opened));
  struct Entry {
    uint64_t offset;
    const TensorInfo* tensor;
  };
  auto table = std::make_shared<std::vector<std::vector<Entry>>>();
  std::vector<std::string> problems;
  std::set<std::string> model_names;
  auto shape_text = [](const std::vector<int64_t>& shape) {
    return fmt::format("[{}]", fmt::join(shape, ", "));
  };
  for (int u = 0; u < cfg.num_units(); ++u) {
    std::vector<Entry> entries;
    uint64_t offset = 0;
    for (const ParamSpec& p : unit_params(unit_kind(cfg, u), cfg)) {
      const std::string name = unit_name(cfg, u) + "." + p.name;
      model_names.insert(name);
      const TensorInfo* t = file->find(name);
      if (t == nullptr) {
        problems.push_back(fmt::format("the model's parameter '{}' {} is not in the file", name,
                                       shape_text(p.shape)));
      } else if (t->shape != p.shape) {
        problems.push_back(fmt::format("tensor '{}' has shape {}, the model's parameter {}", name,
                                       shape_text(t->shape), shape_text(p.shape)));
      }
      entries.push_back({offset, t});
      uint64_t n = 1;
      for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
      offset += n;
    }
    table->push_back(std::move(entries));
  }
  for (const TensorInfo& t : file->tensors()) {
    if (!model_names.count(t.name)) {
      problems.push_back(fmt::format("tensor '{}' {} is not a parameter of the model", t.name,
                                     shape_text(t.shape)));
    }
  }
  if (!problems.empty()) {
    constexpr size_t kNamed = 8;
    std::string list;
    for (size_t i = 0; i < std::min(problems.size(), kNamed); ++i) {
      list += (i == 0 ? "" : "; ") + problems[i];
    }
    if (problems.size() > kNamed) list += fmt::format("; and {} more", problems.size() - kNamed);
    return make_error(ErrorCode::kInvalidArgument,
                      "--init-from {}: the file does not hold this model's parameters ({}: {} "
                      "difference{}): {}",
                      path, describe(cfg), problems.size(), problems.size() == 1 ? "" : "s", list);
  }
  return InitFn([file, table](size_t unit, uint64_t element, uint64_t /*seed*/) {
    const auto& entries = (*table)[unit];
    auto it = std::upper_bound(entries.begin(), entries.end(), element,
                               [](uint64_t e, const Entry& x) { return e < x.offset; });
    --it;
    return file->value(*it->tensor, element - it->offset);
  });
}

struct GatherFailed {
  Status status;
};

// Drives the Engine from the model's callbacks: a unit is gathered when the model asks for it and
// released when the model moves to another unit. The embedding stays open from the head's
// backward (its first gradients) to the embedding's own backward (its last), so its gradients are
// reduced once.
//
// The model computes in fp32: a unit's parameters are converted from the working dtype (fp32,
// bf16 or fp16) into an fp32 copy when it is gathered, and its gradients, summed in fp32, are
// written to the device in the working dtype when its scope ends (16-bit gradients travel through
// the reduction). Where the copies live is the Buffers policy's: on the host for the CPU model
// (HostBuffers), in GPU memory for the GPU model (GpuBuffers). Device memory is reached only
// through the device's operations (UnitScope::params_to_host/_device, grads_from_host/_device).
//
// The copies come from a small pool of buffers kept for the whole run (a few units' worth: the
// open units' parameters and gradients), so that a step allocates nothing. Where the device's
// memory is host memory and the parameters are fp32 (the CPU device), the CPU model needs no
// copies: it computes on the gathered parameters and writes the gradient buffer in place
// (UnitScope::params_in_place, grads_in_place), so a rank holds no second copy of its units.
class HostBuffers {
 public:
  using Buffer = std::vector<float>;
  static constexpr bool kInPlace = true;  // the CPU model may compute on device memory in place

  // A buffer of n elements: one given back earlier with that size (units of a kind are the same
  // size), or a new one. A larger one is not reused: a small unit would pin a large buffer.
  Buffer take(size_t n) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() == n) {
        Buffer v = std::move(*it);
        free_.erase(it);
        return v;
      }
    }
    return Buffer(n);
  }
  void give(Buffer v) {
    if (v.capacity() > 0) free_.push_back(std::move(v));
  }
  static float* data(Buffer& b) { return b.data(); }
  static bool empty(const Buffer& b) { return b.empty(); }
  Status load_params(const UnitScope& scope, Buffer& b) { return scope.params_to_host(b); }
  Status zero(Buffer& b) {
    std::fill(b.begin(), b.end(), 0.0f);
    return Status::ok();
  }
  Status store_grads(UnitScope& scope, const Buffer& b) { return scope.grads_from_host(b); }

 private:
  std::vector<Buffer> free_;
};

#if ZINF_GPT_CUDA
// The GPU model's fp32 copies, in GPU memory allocated on the model's stream.
class GpuBuffers {
 public:
  using Buffer = cuda::DeviceArray<float>;
  static constexpr bool kInPlace = false;  // its kernels compute in its own buffers

  explicit GpuBuffers(cuda::Gpu& gpu) : gpu_(gpu) {}
  Buffer take(size_t n) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() == n) {
        Buffer v = std::move(*it);
        free_.erase(it);
        return v;
      }
    }
    Buffer v;
    v.resize(gpu_, n);
    return v;
  }
  void give(Buffer v) {
    if (v.size() > 0) free_.push_back(std::move(v));
  }
  static float* data(Buffer& b) { return b.data(); }
  static bool empty(const Buffer& b) { return b.size() == 0; }
  // The allocation is ordered on the model's stream; the engine's cast runs on its own stream, so
  // the model's stream is drained first.
  Status load_params(const UnitScope& scope, Buffer& b) {
    ZINF_RETURN_IF_ERROR(sync("allocating a unit's parameter copy"));
    return scope.params_to_device({.data = b.data(), .size = b.size()});
  }
  Status zero(Buffer& b) {
    gpu_.zero(b.data(), b.bytes());
    return Status::ok();  // a failure surfaces at the model's next synchronisation
  }
  // The model has synchronised its stream before asking for another unit (and at its end), so
  // the gradients are complete.
  Status store_grads(UnitScope& scope, const Buffer& b) {
    ZINF_RETURN_IF_ERROR(sync("the unit's gradients"));
    return scope.grads_from_device({.data = b.data(), .size = b.size()});
  }

 private:
  Status sync(std::string_view what) {
    const std::string e = gpu_.synchronize();
    if (e.empty()) return Status::ok();
    return make_error(ErrorCode::kInternal, "GPU, {}: {}", what, e);
  }
  cuda::Gpu& gpu_;
  std::vector<Buffer> free_;
};

// Tests only: a build of this file with ZINF_GPT_TEST_GPU_MODEL (never a shipped one) runs the
// GPU model's path on any device when the test asks, over the host stand-in for the CUDA layers
// (tests/gpt/fake_gpu.cc), so that the path is tested on machines without a GPU.
#if ZINF_GPT_TEST_GPU_MODEL
bool test_gpu_model_on_any_device() { return g_test_gpu_model.load(); }
#else
constexpr bool test_gpu_model_on_any_device() { return false; }
#endif
#endif

template <typename Buffers>
class ScopeAdapter {
 public:
  using Buffer = typename Buffers::Buffer;

  ScopeAdapter(Engine& engine, Buffers& buffers) : engine_(engine), buffers_(buffers) {}
  ~ScopeAdapter() { (void)close_all(); }

  const float* params(int unit) {
    auto it = open_.find(unit);
    if (it == open_.end()) {
      close_others(unit);
      auto scope = engine_.gather(static_cast<size_t>(unit));
      if (!scope.is_ok()) throw GatherFailed{scope.status()};
      it = open_.emplace(unit, Open{.scope = std::move(scope).value()}).first;
      Open& o = it->second;
      if constexpr (Buffers::kInPlace) o.params_in_place = value(o.scope.params_in_place());
      if (o.params_in_place == nullptr) {
        o.params = buffers_.take(o.scope.layout().numel);
        check(buffers_.load_params(o.scope, o.params));
      }
    }
    Open& o = it->second;
    return o.params_in_place != nullptr ? o.params_in_place : Buffers::data(o.params);
  }

  float* grads(int unit) {
    if (!open_.count(unit)) params(unit);
    Open& o = open_.at(unit);
    // In place once, when the model first asks; a scope that fell back to a copy keeps it (the
    // copy is written over the buffer at the scope's end).
    if (o.params_in_place != nullptr && o.grads_in_place == nullptr && Buffers::empty(o.grads)) {
      o.grads_in_place = value(o.scope.grads_in_place());
    }
    if (o.grads_in_place != nullptr) return o.grads_in_place;
    if (Buffers::empty(o.grads)) {
      o.grads = buffers_.take(o.scope.layout().numel);
      check(buffers_.zero(o.grads));
    }
    return Buffers::data(o.grads);
  }

  Status close_all() {
    Status first;
    for (auto& [u, o] : open_) {
      Status s = close(o);
      if (first.is_ok() && !s.is_ok()) first = std::move(s);
    }
    open_.clear();
    return first;
  }

 private:
  struct Open {
    UnitScope scope;
    // In place: the scope's own memory (the copies below stay empty).
    const float* params_in_place = nullptr;
    float* grads_in_place = nullptr;
    Buffer params;  // fp32 copy
    Buffer grads;   // fp32 sums; empty until the model asks for them
  };

  static void check(Status s) {
    if (!s.is_ok()) throw GatherFailed{std::move(s)};
  }
  template <typename T>
  static T value(Result<T> r) {
    if (!r.is_ok()) throw GatherFailed{r.status()};
    return *r;
  }

  // Writes the unit's gradients (if any) to the device and ends its scope (which reduces them).
  Status close(Open& o) {
    Status s;
    if (!Buffers::empty(o.grads)) s = buffers_.store_grads(o.scope, o.grads);
    Status f = o.scope.finish();
    buffers_.give(std::move(o.params));
    buffers_.give(std::move(o.grads));
    return s.is_ok() ? f : s;
  }

  void close_others(int unit) {
    for (auto it = open_.begin(); it != open_.end();) {
      const Open& o = it->second;
      const bool has_grads = o.grads_in_place != nullptr || !Buffers::empty(o.grads);
      const bool keep = it->first == 0 && has_grads && unit != 0;
      if (it->first == unit || keep) {
        ++it;
        continue;
      }
      Status s = close(it->second);
      it = open_.erase(it);
      check(std::move(s));
    }
  }

  Engine& engine_;
  Buffers& buffers_;
  std::map<int, Open> open_;
};

// One micro-step of `run(scopes)` (the model's forward and backward over a ScopeAdapter): the
// scopes still open are closed (their gradients reduced) whatever happens.
template <typename Buffers, typename Run>
Result<double> through_engine(Engine& engine, Buffers& buffers, Run&& run) {
  ScopeAdapter<Buffers> scopes(engine, buffers);
  try {
    Result<double> loss = run(scopes);
    Status closed = scopes.close_all();
    if (!loss.is_ok()) return loss;
    ZINF_RETURN_IF_ERROR(std::move(closed));
    return loss;
  } catch (const GatherFailed& f) {
    (void)scopes.close_all();
    return f.status;
  }
}

struct Shared {
  std::mutex mu;
  TrainReport report;
  std::vector<MemoryReport> memory;
  Status first_failure;  // the rank error that came first: the cause, not a peer's echo of it
  InitFn init;           // the initial values: the model's initialiser, or --init-from's file
};

// `body()`, with an exception (an allocation the system refused, say) turned into an error: a
// rank thread that threw would abort the process and leave its swap files.
template <typename Body>
Status catching(const TrainOptions& o, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kOutOfMemory,
                      "the system refused an allocation (batch {} x {} tokens, model {})", o.batch,
                      o.seq > 0 ? o.seq : o.model.seq, o.model_name);
  } catch (const std::exception& e) {
    return make_error(ErrorCode::kInternal, "{}", e.what());
  }
}

// A rank that fails records its error (the first recorded is the run's: recorded before the
// abort, so the cause comes before its echoes) and aborts the communicator, so that its peers
// stop at once instead of waiting for it until the timeout. Returns the error, naming the rank.
Status fail_rank(comm::Communicator& comm, Shared& shared, const Status& status) {
  Status named = status;
  named.with_context(fmt::format("rank {} of {}", comm.rank(), comm.world_size()));
  {
    // The run reports the cause: a peer's echo of another rank's failure (kUnavailable: "the
    // step failed on 1 other rank", "rank 0 failed: ...") gives way to the failure itself.
    std::lock_guard lock(shared.mu);
    const bool echo = shared.first_failure.code() == ErrorCode::kUnavailable;
    if (shared.first_failure.is_ok() || (echo && status.code() != ErrorCode::kUnavailable)) {
      shared.first_failure = named;
    }
  }
  comm.abort(status);  // the peers' errors name the rank themselves
  return named;
}

Status run_steps(Engine& engine, comm::Communicator& comm, const TrainOptions& o,
                 const TextDataset& data, Shared& shared, const StepCallback& on_step,
                 const optim::LrSchedule& schedule);

// What the trainer keeps in a checkpoint besides the engine's state: the data position (the
// batches are a pure function of seed and step, data.h) and the seed. The learning-rate schedule
// is a pure function of the optimizer steps applied (Engine::last_step().step, restored by
// load_checkpoint), so it needs nothing more; a schedule with state of its own would add it here
// and read it back in resume_from().
std::string checkpoint_user_state(const TrainOptions& o, int64_t step) {
  return nlohmann::json{{"trainer_step", step}, {"seed", o.seed}, {"model", o.model_name}}.dump();
}

// The checkpoint directory `--resume` names.
std::string resume_path(const TrainOptions& o) {
  return o.resume == "latest" ? o.save_dir : o.resume;
}

// Loads the checkpoint into the engine: the step the run continues from.
Result<int64_t> resume_from(Engine& engine, const TrainOptions& o, Shared& shared) {
  const auto t0 = std::chrono::steady_clock::now();
  ZINF_ASSIGN_OR_RETURN(LoadedCheckpoint loaded, engine.load_checkpoint(resume_path(o)));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t step = 0;
  uint64_t seed = 0;
  try {
    const nlohmann::json j = nlohmann::json::parse(loaded.user_state);
    step = j.at("trainer_step").get<int64_t>();
    seed = j.at("seed").get<uint64_t>();
  } catch (const std::exception& ex) {
    return make_error(ErrorCode::kCorrupt, "{}: the trainer's state: {}", loaded.path, ex.what());
  }
  if (seed != o.seed) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} was trained with --seed {}; resuming with --seed {} would draw other "
                      "batches (give --seed {})",
                      loaded.path, seed, o.seed, seed);
  }
  if (engine.rank() == 0) {
    std::lock_guard lock(shared.mu);
    shared.report.resumed_from = step;
    shared.report.resumed_path = loaded.path;
    shared.report.load_seconds = seconds;
    if (auto m = ckpt::read_manifest(loaded.path); m.is_ok()) {
      shared.report.load_bytes = m->total_bytes();
    }
  }
  return step;
}

Status run_rank(comm::Communicator& comm, const TrainOptions& o, const TextDataset& data,
                Shared& shared, const StepCallback& on_step, const StartCallback& on_start) {
  // One GPU per rank: the launcher's local rank (processes) or the rank (threads of one
  // process), modulo the visible GPUs.
  EngineSettings settings = o.engine;
  if (settings.device_ordinal < 0 && cuda_device_count() > 0) {
    settings.device_ordinal = (o.launch ? o.launch->local_rank : comm.rank()) % cuda_device_count();
  }
  ZINF_ASSIGN_OR_RETURN(auto engine,
                        Engine::create(settings, comm, engine_units(o.model), shared.init));
  if (comm.rank() == 0 && on_start) on_start(engine->settings(), engine->budgets());
  ZINF_ASSIGN_OR_RETURN(optim::LrSchedule schedule,
                        optim::LrSchedule::create(o.lr_schedule, o.engine.adam.lr));
  Status status =
      catching(o, [&] { return run_steps(*engine, comm, o, data, shared, on_step, schedule); });
  // Before the engine goes: its destructor waits for the collectives it has in flight, which the
  // abort ends at once on every rank.
  if (!status.is_ok()) return fail_rank(comm, shared, status);
  return status;
}

// One rank's run over its engine (run_rank): the model that computes where the device is, the
// steps and their micro-steps, the step logs, the checkpoints, the stop flag, then every rank's
// memory row, the export and the sample.
class RankSteps {
 public:
  RankSteps(Engine& engine, comm::Communicator& comm, const TrainOptions& o,
            const TextDataset& data, Shared& shared, const StepCallback& on_step,
            const optim::LrSchedule& schedule)
      : engine_(engine),
        comm_(comm),
        o_(o),
        data_(data),
        shared_(shared),
        on_step_(on_step),
        schedule_(schedule),
        rank_(comm.rank()),
        world_(comm.world_size()),
        cfg_(o.model),
        seq_(o.seq > 0 ? o.seq : o.model.seq),
        batch_(o.batch),
        gas_(o.engine.gradient_accumulation_steps),
        model_(o.model) {}

  Status run() {
    ZINF_RETURN_IF_ERROR(choose_model());
    tokens_.resize(static_cast<size_t>(batch_) * seq_);
    targets_.resize(tokens_.size());
    start_logs();
    int64_t first_step = 0;
    if (!o_.resume.empty()) {
      ZINF_ASSIGN_OR_RETURN(first_step, resume_from(engine_, o_, shared_));
    }
    // --init-from with --steps 0: no step; the weights as loaded are saved as step 0 (a
    // checkpoint to resume from, or to export in another dtype).
    if (!o_.init_from.empty() && o_.steps == 0 && !o_.save_dir.empty()) {
      ZINF_RETURN_IF_ERROR(save(0));
    }
    for (int64_t step = first_step; step < o_.steps; ++step) {
      ZINF_ASSIGN_OR_RETURN(const bool stopping, run_step(step));
      if (stopping && step + 1 < o_.steps) {
        ZINF_RETURN_IF_ERROR(engine_.wait_for_update());
        if (rank_ == 0) log_ended_steps();
        return make_error(ErrorCode::kCancelled, "stopped after step {} of {}{}", step + 1,
                          o_.steps,
                          o_.save_dir.empty() ? "" : fmt::format(" (saved in {})", o_.save_dir));
      }
    }
    ZINF_RETURN_IF_ERROR(engine_.wait_for_update());
    if (rank_ == 0) log_ended_steps();
    ZINF_RETURN_IF_ERROR(gather_memory_rows());
    return export_and_sample();
  }

 private:
  // The model that computes where the device is: the CPU model over host copies of the units, or
  // on CUDA the GPU model over copies in GPU memory.
  Status choose_model() {
#if ZINF_GPT_CUDA
    ZINF_ASSIGN_OR_RETURN(const DeviceKind device, resolve_device_kind(o_.engine.device));
    if (device == DeviceKind::kCuda || test_gpu_model_on_any_device()) {
      std::string error;
      gpu_ = cuda::Gpu::create(cuda_ordinal(engine_.settings().device_ordinal), &error);
      if (gpu_ == nullptr) {
        return make_error(ErrorCode::kUnavailable, "the GPT on the GPU: {}", error);
      }
      // bf16 / fp16 runs multiply in that precision on the tensor cores (fp32 accumulation).
      gpu_->set_matmul_inputs(engine_.settings().dtype);
      gpu_model_.emplace(cfg_, *gpu_);
      gpu_buffers_.emplace(*gpu_);
    }
#endif
    return Status::ok();
  }

  // One forward and backward pass of the batch in tokens_/targets_ through the engine.
  Result<double> micro_step(float loss_scale) {
    const int32_t* tok = tokens_.data();
    const int32_t* tgt = targets_.data();
#if ZINF_GPT_CUDA
    if (gpu_model_) {
      return through_engine(engine_, *gpu_buffers_, [&](auto& scopes) {
        return gpu_model_->forward_backward([&](int u) { return scopes.params(u); },
                                            [&](int u) { return scopes.grads(u); }, tok, tgt,
                                            batch_, seq_, loss_scale);
      });
    }
#endif
    return through_engine(engine_, host_buffers_, [&](auto& scopes) -> Result<double> {
      return model_.forward_backward([&](int u) { return scopes.params(u); },
                                     [&](int u) { return scopes.grads(u); }, tok, tgt, batch_, seq_,
                                     loss_scale);
    });
  }

  // One step: its learning rate and betas, its micro-steps, the mean loss (and whether any rank
  // was asked to stop), the engine's step, the checkpoint it is due, its log. Returns whether the
  // run stops after it.
  Result<bool> run_step(int64_t step) {
    auto t0 = std::chrono::steady_clock::now();
    if (!last_end_at_) last_end_at_ = t0;
    ZINF_RETURN_IF_ERROR(apply_schedule());
    double loss_sum = 0;
    for (int m = 0; m < gas_; ++m) {
      ZINF_RETURN_IF_ERROR(data_.sample_batch(o_.seed, static_cast<uint64_t>(step) * gas_ + m,
                                              rank_, batch_, seq_, tokens_.data(),
                                              targets_.data()));
      ZINF_ASSIGN_OR_RETURN(const double loss, micro_step(engine_.loss_scale()));
      loss_sum += loss;
    }
    // The mean loss; with a stop flag, also whether any rank saw it (every rank then stops after
    // this same step).
    float local[2] = {static_cast<float>(loss_sum / gas_), 0}, mean[2] = {local[0], 0};
    if (o_.stop != nullptr && o_.stop->load() != 0) local[1] = 1;
    ZINF_RETURN_IF_ERROR(
        comm_.all_reduce(local, mean, o_.stop ? 2 : 1, DType::kF32, comm::ReduceOp::kAvg).wait());
    const bool stopping = mean[1] > 0;
    ZINF_RETURN_IF_ERROR(engine_.step());
    if (!o_.save_dir.empty() && ((o_.save_every > 0 && (step + 1) % o_.save_every == 0) ||
                                 step + 1 == o_.steps || stopping)) {
      ZINF_RETURN_IF_ERROR(save(step + 1));
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank_ == 0) {
      hold_log(step, mean[0], seconds);
      log_ended_steps();
    }
    return stopping;
  }

  // As DeepSpeed: the schedule advances with each applied step (not with skipped ones).
  Status apply_schedule() {
    const int64_t applied = engine_.last_step().step;
    ZINF_RETURN_IF_ERROR(engine_.set_lr(static_cast<float>(schedule_.lr_for_step(applied))));
    if (std::optional<optim::Betas> b = schedule_.betas_for_step(applied)) {
      ZINF_RETURN_IF_ERROR(
          engine_.set_betas(static_cast<float>(b->beta1), static_cast<float>(b->beta2)));
    }
    return Status::ok();
  }

  Status save(int64_t step) {
    const auto t0 = std::chrono::steady_clock::now();
    ZINF_ASSIGN_OR_RETURN(
        std::string dir,
        engine_.save_checkpoint(
            o_.save_dir,
            {.step = step, .keep = o_.keep, .user_state = checkpoint_user_state(o_, step)}));
    if (rank_ == 0) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto m = ckpt::read_manifest(dir);
      std::lock_guard lock(shared_.mu);
      shared_.report.save_seconds += seconds;
      shared_.report.save_bytes += m.is_ok() ? m->total_bytes() : 0;
      ++shared_.report.saves;
      shared_.report.last_checkpoint = std::move(dir);
    }
    return Status::ok();
  }

  // A step's time and NVMe bytes run to the end of its update, which with update_behind comes
  // after step() returns (during the next step, or at wait_for_update()): rank 0 holds each
  // step's log until the engine has recorded that end (Engine::update_ends()).
  void start_logs() {
    last_store_ = engine_.store_stats();
    for (const Engine::UpdateEnd& end : engine_.update_ends()) ends_seen_ = end.index;
  }

  void hold_log(int64_t step, float loss, double seconds) {
    held_.push_back(
        StepLog{.step = step + 1,
                .loss = loss,
                .seconds = seconds,
                .tokens_per_s = static_cast<double>(batch_) * seq_ * gas_ * world_ / seconds,
                .skipped = engine_.last_step().skipped,
                .grad_norm = engine_.last_step().grad_norm,
                .lr = engine_.settings().adam.lr,
                .beta1 = engine_.settings().adam.beta1,
                .beta2 = engine_.settings().adam.beta2,
                .memory = engine_.memory_report(),
                .comm = engine_.comm_report(),
                .schedule = engine_.schedule_report(),
                .units_updated_early = engine_.last_step().units_updated_early,
                .nvme_minimum = engine_.nvme_traffic_minimum()});
  }

  // The held logs of the steps whose update has ended, completed with their time and NVMe bytes,
  // to the report and on_step.
  void log_ended_steps() {
    for (const Engine::UpdateEnd& end : engine_.update_ends()) {
      if (end.index <= ends_seen_ || held_.empty()) continue;
      ends_seen_ = end.index;
      StepLog log = std::move(held_.front());
      held_.pop_front();
      log.nvme_read = end.stats.bytes_nvme_read - last_store_.bytes_nvme_read;
      log.nvme_written = end.stats.bytes_nvme_written - last_store_.bytes_nvme_written;
      last_store_ = end.stats;
      if (last_end_at_) {
        log.seconds = std::chrono::duration<double>(end.at - *last_end_at_).count();
        log.tokens_per_s =
            log.seconds > 0 ? static_cast<double>(batch_) * seq_ * gas_ * world_ / log.seconds : 0;
      }
      last_end_at_ = end.at;
      {
        std::lock_guard lock(shared_.mu);
        shared_.report.steps.push_back(log);
      }
      if (on_step_) on_step_(log, o_.steps);
    }
  }

  // Every rank's memory row, for rank 0's table (ranks may be other processes).
  Status gather_memory_rows() {
    static_assert(std::is_trivially_copyable_v<MemoryReport>);
    const MemoryReport mine = engine_.memory_report();
    std::vector<MemoryReport> rows(world_);
    ZINF_RETURN_IF_ERROR(comm_.all_gather_bytes(&mine, rows.data(), sizeof mine).wait());
    if (rank_ == 0) {
      std::lock_guard lock(shared_.mu);
      shared_.memory = std::move(rows);
    }
    return Status::ok();
  }

  // The consolidated fp32 weights (a collective: every rank takes part), only when asked for:
  // they are the whole model in memory. Rank 0 exports them and samples from them.
  Status export_and_sample() {
    if (o_.export_path.empty() && o_.sample_bytes <= 0) return Status::ok();
    std::vector<std::vector<float>> full;
    for (size_t u = 0; u < engine_.unit_count(); ++u) {
      ZINF_ASSIGN_OR_RETURN(auto p, engine_.full_parameters(u));
      full.push_back(std::move(p));
    }
    if (rank_ != 0) return Status::ok();
    if (!o_.export_path.empty()) ZINF_RETURN_IF_ERROR(export_safetensors(full));
    if (o_.sample_bytes > 0) {
      ZINF_ASSIGN_OR_RETURN(
          std::string text,
          generate(
              cfg_, [&](int u) { return full[u].data(); }, o_.sample_prompt, o_.sample_bytes,
              {.sampling = Sampling::kRandom, .temperature = 0.8f, .top_k = 40, .seed = o_.seed}));
      std::lock_guard lock(shared_.mu);
      shared_.report.sample = std::move(text);
    }
    return Status::ok();
  }

  // The units' full parameters as named tensors in a safetensors file (--export).
  Status export_safetensors(const std::vector<std::vector<float>>& full) const {
    std::vector<NamedTensor> tensors;
    for (int u = 0; u < cfg_.num_units(); ++u) {
      uint64_t offset = 0;
      for (const ParamSpec& p : unit_params(unit_kind(cfg_, u), cfg_)) {
        uint64_t n = 1;
        for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
        tensors.push_back(
            {unit_name(cfg_, u) + "." + p.name, p.shape,
             std::vector<float>(full[u].begin() + offset, full[u].begin() + offset + n)});
        offset += n;
      }
    }
    return write_safetensors(o_.export_path, tensors);
  }

  Engine& engine_;
  comm::Communicator& comm_;
  const TrainOptions& o_;
  const TextDataset& data_;
  Shared& shared_;
  const StepCallback& on_step_;
  const optim::LrSchedule& schedule_;
  const int rank_, world_;
  const GptConfig& cfg_;
  const int seq_;    // tokens per sequence
  const int batch_;  // sequences per micro-step
  const int gas_;    // micro-steps per step
  Model model_;
  HostBuffers host_buffers_;
#if ZINF_GPT_CUDA
  std::unique_ptr<cuda::Gpu> gpu_;
  std::optional<cuda::GpuModel> gpu_model_;
  std::optional<GpuBuffers> gpu_buffers_;
#endif
  std::vector<int32_t> tokens_, targets_;
  // The step logs held until their update ends (start_logs()).
  StoreStats last_store_;
  std::optional<std::chrono::steady_clock::time_point> last_end_at_;  // the first step's start
  uint64_t ends_seen_ = 0;
  std::deque<StepLog> held_;
};

Status run_steps(Engine& engine, comm::Communicator& comm, const TrainOptions& o,
                 const TextDataset& data, Shared& shared, const StepCallback& on_step,
                 const optim::LrSchedule& schedule) {
  return RankSteps(engine, comm, o, data, shared, on_step, schedule).run();
}

// run_rank with exceptions turned into errors, and any failure (creating the engine included)
// aborting the communicator so that no peer is left waiting for this rank.
Status run_rank_guarded(comm::Communicator& comm, const TrainOptions& o, const TextDataset& data,
                        Shared& shared, const StepCallback& on_step,
                        const StartCallback& on_start) {
  Status status = catching(o, [&] { return run_rank(comm, o, data, shared, on_step, on_start); });
  if (!status.is_ok() && !comm.aborted()) return fail_rank(comm, shared, status);
  return status;
}

}  // namespace

Status check_output_file(std::string_view flag, const std::string& path) {
  if (path.empty()) return make_error(ErrorCode::kInvalidArgument, "{}: an empty path", flag);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return make_error(ErrorCode::kInvalidArgument, "{} {}: a directory, not a file", flag, path);
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return make_error(ErrorCode::kNotFound, "{} {}: the directory {} does not exist", flag, path,
                      dir);
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return errno_status(errno, fmt::format("{} {}: cannot write in {}", flag, path, dir));
  }
  return Status::ok();
}

// Checkpoint flags: the save directory exists (created here) and is writable; the checkpoint to
// resume from is there and its manifest reads.
Status check_checkpoint_options(const TrainOptions& o) {
  if (o.save_every < 0 || o.keep < 0) {
    return make_error(ErrorCode::kInvalidArgument, "--save-every and --keep must be >= 0");
  }
  if (o.save_dir.empty() && (o.save_every > 0 || o.keep > 0)) {
    return make_error(ErrorCode::kInvalidArgument, "--save-every and --keep need --save-dir");
  }
  if (!o.save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.save_dir, ec);
    if (ec) return errno_status(ec.value(), "--save-dir: cannot create " + o.save_dir);
    if (::access(o.save_dir.c_str(), W_OK) != 0) {
      return errno_status(errno, "--save-dir: cannot write in " + o.save_dir);
    }
  }
  if (o.resume.empty()) return Status::ok();
  if (o.resume == "latest" && o.save_dir.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "--resume latest needs --save-dir");
  }
  ZINF_ASSIGN_OR_RETURN(std::string dir, ckpt::resolve_checkpoint(resume_path(o)));
  return std::move(ckpt::read_manifest(dir)).take_status().with_context("--resume");
}

Status check_train_options(const TrainOptions& o) {
  ZINF_RETURN_IF_ERROR(validate(o.model));
  ZINF_RETURN_IF_ERROR(optim::LrSchedule::create(o.lr_schedule, o.engine.adam.lr).status());
  if (!o.export_path.empty()) ZINF_RETURN_IF_ERROR(check_output_file("--export", o.export_path));
  if (!o.log_json.empty()) ZINF_RETURN_IF_ERROR(check_output_file("--log-json", o.log_json));
  if (!o.init_from.empty() && !o.resume.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--init-from and --resume exclude each other: --resume continues a run from "
                      "its checkpoint (weights, optimizer state and step), --init-from starts a "
                      "new one from weights alone");
  }
  ZINF_RETURN_IF_ERROR(check_checkpoint_options(o));
  if (!o.init_from.empty()) {
    // Opened and checked against the model here, before anything is allocated.
    ZINF_RETURN_IF_ERROR(make_file_init(o.model, o.init_from).status());
  }
  if (o.batch < 1) return make_error(ErrorCode::kInvalidArgument, "--batch must be at least 1");
  if (o.steps < 0 || (o.steps == 0 && o.init_from.empty())) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--steps must be at least 1 (0 only with --init-from, to export or save the "
                      "weights it loads)");
  }
  if (!o.launch && (o.ranks < 1 || o.ranks > 64)) {
    return make_error(ErrorCode::kInvalidArgument, "--ranks must be 1..64, got {}", o.ranks);
  }
  const int T = o.seq > 0 ? o.seq : o.model.seq;
  if (T > o.model.seq) {
    return make_error(ErrorCode::kInvalidArgument,
                      "sequence length {} is longer than the model's context {}", T, o.model.seq);
  }
  // The device and host budgets are checked by the engine when it is built, which knows the
  // whole working set (state homed there, staging, the unit at work, the CPU update's copies).
  const uint64_t wsize = dtype_size(o.engine.dtype);
  const uint64_t P = static_cast<uint64_t>(parameter_count(o.model));
  // NVMe: room for what goes there (every local rank writes to the same paths).
  uint64_t nvme_bytes = 0;
  if (o.engine.param_home == Tier::kNvme) nvme_bytes += P * wsize;
  if (o.engine.optimizer_home == Tier::kNvme) nvme_bytes += P * (12 + (wsize == 4 ? 0 : 4));
  if (nvme_bytes > 0) {
    if (o.engine.nvme_paths.empty()) {
      return make_error(ErrorCode::kInvalidArgument, "NVMe offload needs --nvme-path");
    }
    uint64_t avail = 0;
    for (const std::string& dir : o.engine.nvme_paths) {
      struct statvfs vfs {};
      if (::statvfs(dir.c_str(), &vfs) != 0) {
        return errno_status(errno, fmt::format("NVMe path {} is not usable", dir));
      }
      avail += static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    }
    uint64_t need = nvme_bytes + nvme_bytes / 8;  // and room for padding and file growth
    if (avail < need) {
      return make_error(
          ErrorCode::kNoSpace, "the NVMe paths have {} free; offloading this model needs about {}",
          format_bytes(static_cast<double>(avail)), format_bytes(static_cast<double>(need)));
    }
  }
  return Status::ok();
}

Result<TrainReport> train(const TrainOptions& o, const StepCallback& on_step,
                          const StartCallback& on_start) {
  ZINF_RETURN_IF_ERROR(check_train_options(o));
  ZINF_ASSIGN_OR_RETURN(TextDataset data, TextDataset::load(o.data));
  const int T = o.seq > 0 ? o.seq : o.model.seq;
  ZINF_RETURN_IF_ERROR(data.check_window(T));

  Shared shared;
  if (o.init_from.empty()) {
    shared.init = make_init(o.model);
  } else {
    ZINF_ASSIGN_OR_RETURN(shared.init, make_file_init(o.model, o.init_from));
  }
  std::vector<Status> status;
  if (o.launch) {
    ZINF_ASSIGN_OR_RETURN(auto comm, comm::create_communicator(*o.launch));
    shared.memory.resize(comm->world_size());
    shared.report.world = comm->world_size();
    status.push_back(run_rank_guarded(*comm, o, data, shared, on_step, on_start));
  } else {
    ZINF_ASSIGN_OR_RETURN(auto group, comm::make_local_group(o.ranks, {.timeout = o.comm_timeout}));
    shared.memory.resize(o.ranks);
    shared.report.world = o.ranks;
    status.resize(o.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r) {
      threads.emplace_back(
          [&, r] { status[r] = run_rank_guarded(*group[r], o, data, shared, on_step, on_start); });
    }
    for (auto& t : threads) t.join();
  }
  // The cause first: the peers of a failed rank fail too, with an error that only echoes it.
  ZINF_RETURN_IF_ERROR(shared.first_failure);
  for (Status& s : status) ZINF_RETURN_IF_ERROR(s);
  TrainReport report = std::move(shared.report);
  report.memory = std::move(shared.memory);
  report.parameters = parameter_count(o.model);
  auto units = engine_units(o.model);
  for (auto& u : units) {
    report.padded_parameters +=
        zero::make_shard_layout(u, report.world, o.engine.dtype)->numel_padded;
  }
  if (!report.steps.empty()) {
    report.initial_loss = report.steps.front().loss;
    size_t tail = std::max<size_t>(1, report.steps.size() / 10);
    double sum = 0;
    for (size_t i = report.steps.size() - tail; i < report.steps.size(); ++i) {
      sum += report.steps[i].loss;
    }
    report.final_loss = sum / static_cast<double>(tail);
  }
  return report;
}

}  // namespace zinf::gpt
