// Checkpoints through the Engine: K steps straight equal K/2 steps, save, load into a fresh
// engine, K/2 steps, bit for bit; a corrupt or truncated shard is refused with its file named;
// loading at another world size and stage gives the saved parameters bit for bit; a save killed
// at any point leaves the last complete checkpoint loadable.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "engine/mlp.h"
#include "io/test_dir.h"
#include "zinf/ckpt/directory.h"
#include "zinf/ckpt/export.h"
#include "zinf/ckpt/manifest.h"

namespace zinf {
namespace {

using testing::MlpShape;
using testing::TempDir;

struct Mode {
  int stage;
  Tier params, optimizer;
};
// Every stage, and every offload mode stage 3 allows (tests/gpt/trainer_test.cc's kModes).
constexpr Mode kModes[] = {{0, Tier::kDevice, Tier::kDevice}, {1, Tier::kDevice, Tier::kHost},
                           {2, Tier::kDevice, Tier::kNvme},   {3, Tier::kDevice, Tier::kDevice},
                           {3, Tier::kHost, Tier::kHost},     {3, Tier::kNvme, Tier::kNvme}};

EngineSettings settings_for(const Mode& m, DType dtype, const std::string& nvme) {
  EngineSettings s;
  s.stage = m.stage;
  s.dtype = dtype;
  s.param_home = m.params;
  s.optimizer_home = m.optimizer;
  s.nvme_paths = {nvme};
  s.adam.lr = 1e-2f;
  s.gradient_clipping = 1.0f;
  s.gradient_accumulation_steps = 2;
  s.device_mem = 64ull << 20;
  s.host_mem = 64ull << 20;
  return s;
}

struct Outcome {
  std::vector<std::vector<float>> params;  // per unit, whole (rank 0)
  std::vector<float> losses;               // rank 0
  std::vector<float> loss_scales;          // rank 0, after each step
  LoadedCheckpoint loaded;                 // rank 0
  Status status;
};

// Steps [first, last) of the MLP on `world` local ranks: loads `load_from` first when given,
// saves into `save_root` after every `save_every` steps (counted from 0) when given.
Outcome run(const EngineSettings& s, int world, int first, int last,
            const std::string& load_from = "", const std::string& save_root = "",
            int save_every = 0, int keep = 0) {
  Outcome out;
  const MlpShape shape;
  auto group = comm::make_local_group(world).value();
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](Status st) { status[r] = std::move(st); };
      auto engine = Engine::create(s, *group[r], testing::mlp_units(shape), testing::mlp_init);
      if (!engine.is_ok()) return fail(engine.status());
      Engine& e = **engine;
      if (!load_from.empty()) {
        auto loaded = e.load_checkpoint(load_from);
        if (!loaded.is_ok()) return fail(loaded.status());
        if (r == 0) out.loaded = *loaded;
      }
      const int gas = s.gradient_accumulation_steps, micro = 3;
      for (int step = first; step < last; ++step) {
        float loss_sum = 0;
        for (int m = 0; m < gas; ++m) {
          std::vector<uint64_t> samples;
          for (int i = 0; i < micro; ++i) {
            // Different samples every step: a resumed run must take up the data where it was.
            samples.push_back(((static_cast<uint64_t>(step) * world + r) * gas + m) * micro + i);
          }
          auto loss = testing::mlp_micro_step(e, shape, samples);
          if (!loss.is_ok()) return fail(loss.status());
          loss_sum += *loss;
        }
        if (Status st = e.step(); !st.is_ok()) return fail(st);
        if (r == 0) {
          out.losses.push_back(loss_sum / gas);
          out.loss_scales.push_back(e.last_step().loss_scale);
        }
        if (save_every > 0 && (step + 1) % save_every == 0) {
          auto saved = e.save_checkpoint(save_root,
                                         {.step = step + 1,
                                          .keep = keep,
                                          .user_state = fmt::format("{{\"step\": {}}}", step + 1)});
          if (!saved.is_ok()) return fail(saved.status());
        }
      }
      if (first == last && !save_root.empty()) {  // loaded and saved again, no step between
        auto saved = e.save_checkpoint(save_root, {.step = first});
        if (!saved.is_ok()) return fail(saved.status());
      }
      for (size_t u = 0; u < e.unit_count(); ++u) {
        auto p = e.full_parameters(u);
        if (!p.is_ok()) return fail(p.status());
        if (r == 0) out.params.push_back(std::move(*p));
      }
    });
  }
  for (auto& t : threads) t.join();
  // The cause first: a peer's echo of it (kUnavailable) only if there is nothing else.
  for (Status& st : status) {
    if (!st.is_ok() && (out.status.is_ok() || out.status.code() == ErrorCode::kUnavailable)) {
      out.status = st;
    }
  }
  return out;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.empty() || a.size() != b.size()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() || std::memcmp(a[u].data(), b[u].data(), a[u].size() * 4)) {
      return false;
    }
  }
  return true;
}

constexpr int kSteps = 6;

TEST(Checkpoint, ResumeIsExactInEveryStageOffloadModeAndPrecision) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Mode& m : kModes) {
      const std::string what = fmt::format("{} stage {} params {} optimizer {}", dtype_name(dtype),
                                           m.stage, tier_name(m.params), tier_name(m.optimizer));
      TempDir nvme, ckpt;
      const EngineSettings s = settings_for(m, dtype, nvme.path());
      const int world = 2;
      Outcome straight = run(s, world, 0, kSteps);
      ASSERT_TRUE(straight.status.is_ok()) << what << ": " << straight.status.to_string();
      // The first half saves at its end; the second starts from it in fresh engines.
      Outcome half = run(s, world, 0, kSteps / 2, "", ckpt.path(), kSteps / 2);
      ASSERT_TRUE(half.status.is_ok()) << what << ": " << half.status.to_string();
      Outcome resumed = run(s, world, kSteps / 2, kSteps, ckpt.path());
      ASSERT_TRUE(resumed.status.is_ok()) << what << ": " << resumed.status.to_string();
      EXPECT_EQ(resumed.loaded.step, kSteps / 2) << what;
      // fp16 skips its first steps while the loss scale comes down.
      if (dtype != DType::kF16) {
        EXPECT_EQ(resumed.loaded.optimizer_steps, kSteps / 2) << what;
      }
      EXPECT_EQ(resumed.loaded.user_state, "{\"step\":3}") << what;
      EXPECT_TRUE(same_bits(straight.params, resumed.params)) << what;
      std::vector<float> losses = half.losses;
      losses.insert(losses.end(), resumed.losses.begin(), resumed.losses.end());
      EXPECT_EQ(losses, straight.losses) << what;
      std::vector<float> scales = half.loss_scales;
      scales.insert(scales.end(), resumed.loss_scales.begin(), resumed.loss_scales.end());
      EXPECT_EQ(scales, straight.loss_scales) << what;
    }
  }
}

// The comparison above is not vacuous: resuming from another step's checkpoint, or not loading
// at all, ends elsewhere.
TEST(Checkpoint, TheResumeComparisonDetectsAWrongStartingPoint) {
  TempDir nvme, ckpt;
  const EngineSettings s = settings_for(kModes[3], DType::kBF16, nvme.path());
  Outcome straight = run(s, 2, 0, kSteps);
  ASSERT_TRUE(straight.status.is_ok()) << straight.status.to_string();
  Outcome early = run(s, 2, 0, kSteps / 2 - 1, "", ckpt.path(), kSteps / 2 - 1);
  ASSERT_TRUE(early.status.is_ok()) << early.status.to_string();
  Outcome resumed = run(s, 2, kSteps / 2, kSteps, ckpt.path());
  ASSERT_TRUE(resumed.status.is_ok()) << resumed.status.to_string();
  EXPECT_FALSE(same_bits(straight.params, resumed.params));
  Outcome fresh = run(s, 2, kSteps / 2, kSteps);
  ASSERT_TRUE(fresh.status.is_ok()) << fresh.status.to_string();
  EXPECT_FALSE(same_bits(straight.params, fresh.params));
}

// Flips one byte of `path` at `offset`.
void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(Checkpoint, ACorruptOrTruncatedShardIsRefusedNamingTheFile) {
  TempDir nvme, ckpt;
  const EngineSettings s = settings_for(kModes[5], DType::kBF16, nvme.path());
  ASSERT_TRUE(run(s, 2, 0, 2, "", ckpt.path(), 2).status.is_ok());
  const std::string dir = ckpt.path() + "/step-2";
  ASSERT_TRUE(run(s, 2, 2, 3, ckpt.path()).status.is_ok());  // it loads as saved
  {
    const std::string file = dir + "/rank-00001.adam_m.bin";
    flip_byte(file, 100);
    Outcome r = run(s, 2, 2, 3, ckpt.path());
    ASSERT_FALSE(r.status.is_ok());
    EXPECT_NE(r.status.message().find(file), std::string::npos) << r.status.to_string();
    EXPECT_NE(r.status.message().find("corrupt"), std::string::npos) << r.status.to_string();
    flip_byte(file, 100);  // restored: it loads again
    ASSERT_TRUE(run(s, 2, 2, 3, ckpt.path()).status.is_ok());
  }
  {
    const std::string file = dir + "/rank-00000.master.bin";
    std::filesystem::resize_file(file, std::filesystem::file_size(file) - 1);
    Outcome r = run(s, 2, 2, 3, dir);
    ASSERT_FALSE(r.status.is_ok());
    EXPECT_NE(r.status.message().find(file), std::string::npos) << r.status.to_string();
    EXPECT_NE(r.status.message().find("truncated"), std::string::npos) << r.status.to_string();
  }
  {  // a manifest that is not JSON
    std::ofstream(dir + "/manifest.json") << "{\"format\": ";
    Outcome r = run(s, 2, 2, 3, dir);
    ASSERT_FALSE(r.status.is_ok());
    EXPECT_NE(r.status.message().find(dir + "/manifest.json"), std::string::npos)
        << r.status.to_string();
  }
  {  // nothing there
    Outcome r = run(s, 1, 0, 1, nvme.path());
    ASSERT_FALSE(r.status.is_ok());
    EXPECT_EQ(r.status.code(), ErrorCode::kNotFound) << r.status.to_string();
  }
}

TEST(Checkpoint, AnotherModelIsRefused) {
  TempDir nvme, ckpt;
  EngineSettings s = settings_for(kModes[0], DType::kF32, nvme.path());
  ASSERT_TRUE(run(s, 1, 0, 1, "", ckpt.path(), 1).status.is_ok());
  s.dtype = DType::kBF16;
  Outcome r = run(s, 1, 1, 2, ckpt.path());
  ASSERT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("saved in fp32"), std::string::npos) << r.status.to_string();
}

TEST(Checkpoint, KeepRemovesTheOlderOnesAndLatestNamesTheNewest) {
  TempDir nvme, ckpt;
  const EngineSettings s = settings_for(kModes[3], DType::kF32, nvme.path());
  for (int i = 1; i <= 4; ++i) {
    ASSERT_TRUE(run(s, 2, i - 1, i, i > 1 ? ckpt.path() : "", ckpt.path(), i, 2).status.is_ok());
  }
  EXPECT_EQ(ckpt::list_steps(ckpt.path()), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(*ckpt::resolve_checkpoint(ckpt.path()), ckpt.path() + "/step-4");
  // Nothing but the checkpoints and the pointer is left behind.
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(ckpt.path())) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-3", "step-4"}));
}

// The reader refuses `user` state nested deeper than ckpt::kMaxStateDepth (copying it would
// recurse that deep); a save refuses to write it rather than leave a checkpoint that cannot load.
TEST(Checkpoint, UserStateTheReaderWouldRefuseIsNotSaved) {
  TempDir nvme, ckpt;
  auto group = comm::make_local_group(1).value();
  auto engine = Engine::create(settings_for(kModes[0], DType::kF32, nvme.path()), *group[0],
                               testing::mlp_units(MlpShape{}), testing::mlp_init);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  auto nested = [](int levels) { return std::string(levels, '[') + std::string(levels, ']'); };
  auto refused = (*engine)->save_checkpoint(
      ckpt.path(), {.step = 1, .user_state = nested(ckpt::kMaxStateDepth + 1)});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("nests 65 levels deep"), std::string::npos)
      << refused.status().to_string();
  EXPECT_TRUE(std::filesystem::is_empty(ckpt.path()));  // no step, no temporary directory
  auto saved = (*engine)->save_checkpoint(ckpt.path(),
                                          {.step = 2, .user_state = nested(ckpt::kMaxStateDepth)});
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  auto loaded = (*engine)->load_checkpoint(*saved);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->user_state, nested(ckpt::kMaxStateDepth));
}

// The checkpoint under `root` exported as safetensors (in `dtype`), its bytes.
std::string exported(const std::string& root, DType dtype) {
  auto dir = ckpt::resolve_checkpoint(root);
  if (!dir.is_ok()) return dir.status().to_string();
  auto m = ckpt::read_manifest(*dir);
  if (!m.is_ok()) return m.status().to_string();
  const std::string out = root + "/exported.safetensors";
  if (Status st = ckpt::export_safetensors(*dir, *m, out, dtype); !st.is_ok()) {
    return st.to_string();
  }
  std::ifstream f(out, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::filesystem::remove(out);
  return bytes;
}

// A save of a step that exists replaces it; a crash half-way through the replacement (the old
// one moved aside, the new one not yet in place) still resolves to a complete checkpoint.
TEST(Checkpoint, ReplacingAStepKeepsACompleteOneAtEveryPoint) {
  TempDir nvme, ckpt;
  const EngineSettings s = settings_for(kModes[3], DType::kF32, nvme.path());
  EngineSettings faster = s;
  faster.adam.lr = 3e-2f;
  ASSERT_TRUE(run(s, 1, 0, 2, "", ckpt.path(), 2).status.is_ok());
  Outcome first = run(s, 1, 2, 2, ckpt.path());
  ASSERT_TRUE(first.status.is_ok()) << first.status.to_string();
  // step-2 saved again from a run with another learning rate: it replaces the first.
  ASSERT_TRUE(run(faster, 1, 0, 2, "", ckpt.path(), 2).status.is_ok());
  Outcome second = run(s, 1, 2, 2, ckpt.path());
  ASSERT_TRUE(second.status.is_ok()) << second.status.to_string();
  EXPECT_FALSE(same_bits(first.params, second.params));
  EXPECT_EQ(ckpt::list_steps(ckpt.path()), (std::vector<int64_t>{2}));
  // A third save of step 2 that died after moving step-2 aside and before its own was in place
  // (its process gone: an impossible pid), `latest` still naming step-2: the complete one aside
  // is found.
  const std::string aside = ckpt.path() + "/old-2-999999999";
  std::filesystem::rename(ckpt.path() + "/step-2", aside);
  auto dir = ckpt::resolve_checkpoint(ckpt.path());
  ASSERT_TRUE(dir.is_ok()) << dir.status().to_string();
  EXPECT_EQ(*dir, aside);
  Outcome loaded = run(s, 1, 2, 2, ckpt.path());
  ASSERT_TRUE(loaded.status.is_ok()) << loaded.status.to_string();
  EXPECT_TRUE(same_bits(loaded.params, second.params));
  // prune() keeps it while step-2 is missing.
  ASSERT_TRUE(ckpt::prune(ckpt.path(), 1).is_ok());
  EXPECT_TRUE(std::filesystem::exists(aside));
}

// Saved at world size 4 in stage 3, loaded at 2 and 1 in other stages: the parameters loaded are
// the saved ones bit for bit, and the run continues.
TEST(Checkpoint, LoadsAtAnotherWorldSizeAndStage) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    TempDir nvme, ckpt;
    const EngineSettings s4 = settings_for(kModes[5], dtype, nvme.path());
    Outcome saved = run(s4, 4, 0, 2, "", ckpt.path(), 2);
    ASSERT_TRUE(saved.status.is_ok()) << saved.status.to_string();
    for (const Mode& m : {kModes[0], kModes[1], kModes[4]}) {
      for (int world : {2, 1}) {
        const std::string what =
            fmt::format("{} world {} stage {}", dtype_name(dtype), world, m.stage);
        TempDir again;
        Outcome loaded =
            run(settings_for(m, dtype, nvme.path()), world, 2, 2, ckpt.path(), again.path());
        ASSERT_TRUE(loaded.status.is_ok()) << what << ": " << loaded.status.to_string();
        EXPECT_TRUE(same_bits(saved.params, loaded.params)) << what;
        // Exported directly, and after loading at this world size and stage and saving again:
        // the same bytes.
        EXPECT_EQ(exported(ckpt.path(), dtype), exported(again.path(), dtype)) << what;
        Outcome more = run(settings_for(m, dtype, nvme.path()), world, 2, 3, ckpt.path());
        ASSERT_TRUE(more.status.is_ok()) << what << ": " << more.status.to_string();
        EXPECT_FALSE(same_bits(saved.params, more.params)) << what;
      }
    }
  }
}

// The child of the test below: loads the latest checkpoint, then takes a step and saves, again
// and again (step-2, step-3, ..., keeping 2). Skipped unless that test started it.
TEST(Checkpoint, SaverForTheKillTest) {
  const char* root = std::getenv("ZINF_TEST_SAVER_ROOT");
  const char* nvme = std::getenv("ZINF_TEST_SAVER_NVME");
  if (root == nullptr || nvme == nullptr) GTEST_SKIP() << "run by the kill test only";
  Outcome r = run(settings_for(kModes[5], DType::kBF16, nvme), 1, 1, 100000, root, root, 1, 2);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
}

// The newest step directory a save has put in place under `root` (0 if none).
int64_t newest_step(const std::string& root) {
  const std::vector<int64_t> steps = ckpt::list_steps(root);
  return steps.empty() ? 0 : *std::max_element(steps.begin(), steps.end());
}

// A child saves again and again; once it has put a new step in place, the parent kills it with
// SIGKILL after a random delay of up to about one save's length, so that the kills land anywhere
// in a save however fast or slow the machine is. Whatever the moment, `latest` names a complete
// checkpoint that verifies and loads, and every round leaves at least one more step than the last.
TEST(Checkpoint, ASaveKilledAtARandomPointLeavesTheLastCompleteOne) {
  TempDir nvme, ckpt;
  const EngineSettings s = settings_for(kModes[5], DType::kBF16, nvme.path());
  // A first complete checkpoint, so that there is always one.
  ASSERT_TRUE(run(s, 1, 0, 1, "", ckpt.path(), 1).status.is_ok());
  std::mt19937 rng(12345);
  constexpr int kRounds = 12;
  int checked = 0;
  int64_t last_step = 1;
  for (int round = 0; round < kRounds; ++round) {
    const int64_t before = newest_step(ckpt.path());
    // This binary again, running only the saver below (a fresh process: no threads forked).
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::setenv("ZINF_TEST_SAVER_ROOT", ckpt.path().c_str(), 1);
      ::setenv("ZINF_TEST_SAVER_NVME", nvme.path().c_str(), 1);
      ::execl("/proc/self/exe", "ckpt_test", "--gtest_filter=Checkpoint.SaverForTheKillTest",
              static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    // Wait (at most two minutes) for the child's first save, then time its second.
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::minutes(2);
    int64_t seen = before;
    bool exited = false;
    int wstatus = 0;
    while (seen <= before && !exited && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      seen = newest_step(ckpt.path());
      exited = ::waitpid(child, &wstatus, WNOHANG) == child;
    }
    const auto first_save = std::chrono::steady_clock::now();
    if (seen > before) {
      // One step and save take about as long as the time to the first save, less the load.
      const auto period = std::chrono::duration_cast<std::chrono::milliseconds>(first_save - start);
      const int most = std::max<int>(20, static_cast<int>(period.count()));
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, most)(rng)));
    }
    if (!exited) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &wstatus, 0);
    }
    // What a killed process leaves behind (its preallocated swap space) goes now, not with the
    // test's directory: twelve of them would hold gigabytes of disk.
    const std::string mine = fmt::format("zinf-{}-", child);
    for (const auto& entry : std::filesystem::directory_iterator(nvme.path())) {
      if (entry.path().filename().string().starts_with(mine)) {
        std::filesystem::remove_all(entry.path());
      }
    }
    ASSERT_FALSE(exited && seen <= before)
        << "round " << round << ": the saver exited before saving (status " << wstatus << ")";
    ASSERT_GT(seen, before) << "round " << round << ": the saver put no new step in place in "
                            << "two minutes";
    auto dir = ckpt::resolve_checkpoint(ckpt.path());
    ASSERT_TRUE(dir.is_ok()) << dir.status().to_string();
    auto m = ckpt::read_manifest(*dir);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    ASSERT_TRUE(ckpt::verify_all(*dir, *m).is_ok()) << *dir;
    Outcome loaded = run(s, 1, 0, 0, ckpt.path());
    ASSERT_TRUE(loaded.status.is_ok()) << loaded.status.to_string();
    // The checkpoint loaded is the newest complete one, no older than the save seen in place.
    EXPECT_GE(loaded.loaded.step, seen) << "round " << round;
    ++checked;
    last_step = loaded.loaded.step;
  }
  EXPECT_EQ(checked, kRounds);
  EXPECT_GE(last_step, 1 + kRounds);
  std::printf("the last complete checkpoint after %d kills: step %lld\n", kRounds,
              static_cast<long long>(last_step));
}

}  // namespace
}  // namespace zinf
