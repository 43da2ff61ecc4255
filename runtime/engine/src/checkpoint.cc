#include "checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "zinf/ckpt/directory.h"
#include "zinf/ckpt/files.h"

namespace zinf::engine_detail {
namespace {

using nlohmann::json;

// Every rank's outcome: the collective runs whatever failed here, so that no rank waits in a
// collective the others skipped.
Status agree(comm::Communicator& comm, Status local, const char* what) {
  if (comm.world_size() == 1) return local;
  float failed = local.is_ok() ? 0.0f : 1.0f, total = 0;
  Status ws = comm.all_reduce(&failed, &total, 1, DType::kF32, comm::ReduceOp::kSum).wait();
  if (!local.is_ok()) return local;
  if (!ws.is_ok()) return ws;
  if (total > 0) {
    return make_error(ErrorCode::kUnavailable,
                      "{} failed on {} other rank(s) (their errors name the cause)", what,
                      static_cast<int>(total));
  }
  return Status::ok();
}

// Between steps only: nothing open, in flight or half-updated.
Status check_between_steps(EngineState& e, const char* what) {
  if (!e.sticky.is_ok()) return e.sticky;
  if (e.update_incomplete) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: the last step() failed half-way; call step() again first", what);
  }
  for (size_t u = 0; u < e.unit_states.size(); ++u) {
    if (e.unit_states[u].scopes > 0) {
      return make_error(ErrorCode::kInvalidArgument, "{}: unit {} has a scope open", what,
                        e.units[u].name);
    }
  }
  return e.finish_evictions();
}

const char* tier_word(Tier t) {
  return t == Tier::kNvme ? "nvme" : t == Tier::kHost ? "cpu" : "none";
}

// ---- save ---------------------------------------------------------------------------------------

class Saver {
 public:
  Saver(EngineState& e, std::string dir) : e_(e), dir_(std::move(dir)) {}

  Status write_all() {
    const std::string prefix = fmt::format("rank-{:05d}", e_.rank);
    ZINF_ASSIGN_OR_RETURN(params_, ckpt::ShardWriter::create(dir_, prefix + ".params.bin"));
    if (e_.mixed) {
      ZINF_ASSIGN_OR_RETURN(master_, ckpt::ShardWriter::create(dir_, prefix + ".master.bin"));
    }
    ZINF_ASSIGN_OR_RETURN(m_, ckpt::ShardWriter::create(dir_, prefix + ".adam_m.bin"));
    ZINF_ASSIGN_OR_RETURN(v_, ckpt::ShardWriter::create(dir_, prefix + ".adam_v.bin"));
    for (size_t u = 0; u < e_.unit_states.size(); ++u) {
      const UnitState& st = e_.unit_states[u];
      const uint64_t begin = e_.policy.param_begin(st.layout, e_.rank);
      ZINF_RETURN_IF_ERROR(write(params_, ckpt::kParams, u, st.params, e_.s.param_home, begin,
                                 begin + e_.policy.param_elements(st.layout), e_.s.dtype));
      for (size_t pi : st.pieces) {
        const PieceState& p = e_.pieces[pi];
        if (e_.mixed) {
          ZINF_RETURN_IF_ERROR(
              write(master_, ckpt::kMaster, u, p.master, st.opt_home, p.begin, p.end, DType::kF32));
        }
        ZINF_RETURN_IF_ERROR(
            write(m_, ckpt::kAdamM, u, p.m, st.opt_home, p.begin, p.end, DType::kF32));
        ZINF_RETURN_IF_ERROR(
            write(v_, ckpt::kAdamV, u, p.v, st.opt_home, p.begin, p.end, DType::kF32));
      }
    }
    for (ckpt::ShardWriter* w : {&params_, &master_, &m_, &v_}) {
      if (w->path().empty()) continue;
      ZINF_ASSIGN_OR_RETURN(ckpt::FileDigest d, w->finish());
      entry_.files.push_back(std::move(d));
    }
    entry_.rank = e_.rank;
    return ckpt::write_small_file(dir_, fmt::format("rank-{:05d}.json", e_.rank),
                                  ckpt::to_json(entry_).dump())
        .status();
  }

 private:
  // One tensor, through a host copy (the home itself for host-homed state; a copy read from the
  // device or NVMe otherwise, dropped afterwards unless it was cached before: one tensor's worth
  // of extra host memory at a time, within the host budget).
  Status write(ckpt::ShardWriter& w, const char* kind, size_t u, TensorId id, Tier home,
               uint64_t begin, uint64_t end, DType dtype) {
    const uint64_t bytes = (end - begin) * dtype_size(dtype);
    const std::string& name = e_.store->spec(id).name;
    const bool cached = e_.store->residency(id).valid[static_cast<int>(Tier::kHost)];
    {
      ZINF_ASSIGN_OR_RETURN(TensorHandle h, e_.store->acquire(id, Tier::kHost));
      ZINF_CHECK(h.bytes() >= bytes, "tensor {}: {} bytes, the segment needs {}", name, h.bytes(),
                 bytes);
      entry_.segments.push_back({.unit = static_cast<uint32_t>(u),
                                 .kind = kind,
                                 .flat_begin = begin,
                                 .flat_end = end,
                                 .dtype = dtype,
                                 .file = w.path().substr(dir_.size() + 1),
                                 .offset = w.offset()});
      ZINF_RETURN_IF_ERROR(w.write(h.data(), bytes).with_context("saving tensor " + name));
    }
    // A copy made for the save is dropped; one that was there before stays (the cache as it was).
    if (home != Tier::kHost && !cached) ZINF_RETURN_IF_ERROR(e_.store->evict(id, Tier::kHost));
    return Status::ok();
  }

  EngineState& e_;
  std::string dir_;
  ckpt::ShardWriter params_, master_, m_, v_;
  ckpt::RankEntry entry_;
};

// Rank 0, once every rank has written its files: the manifest, from the ranks' entries.
Status write_manifest(EngineState& e, const std::string& dir, int64_t step, const json& scalars,
                      const std::string& user_state) {
  ckpt::Manifest m{.step = step,
                   .world = e.world,
                   .stage = e.s.stage,
                   .dtype = e.s.dtype,
                   .mixed = e.mixed,
                   .param_home = tier_word(e.s.param_home),
                   .optimizer_home = tier_word(e.s.optimizer_home)};
  for (size_t u = 0; u < e.units.size(); ++u) {
    const zero::ShardLayout& l = e.unit_states[u].layout;
    ckpt::UnitEntry entry{.name = e.units[u].name,
                          .numel = l.numel,
                          .numel_padded = l.numel_padded,
                          .shard_numel = l.shard_numel};
    for (size_t i = 0; i < l.params.size(); ++i) {
      entry.params.push_back({.name = l.params[i].name,
                              .shape = e.units[u].params[i].shape,
                              .offset = l.params[i].offset,
                              .numel = l.params[i].numel});
    }
    m.units.push_back(std::move(entry));
  }
  m.engine = scalars;
  try {
    m.user = json::parse(user_state);
  } catch (const std::exception& ex) {
    return make_error(ErrorCode::kInvalidArgument, "the checkpoint's user state is not JSON: {}",
                      ex.what());
  }
  // What parse_manifest would refuse to read back.
  if (const int depth = ckpt::json_depth(m.user); depth > ckpt::kMaxStateDepth) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the checkpoint's user state nests {} levels deep, more than {}", depth,
                      ckpt::kMaxStateDepth);
  }
  for (int r = 0; r < e.world; ++r) {
    const std::string name = fmt::format("rank-{:05d}.json", r);
    ZINF_ASSIGN_OR_RETURN(std::string text, ckpt::read_small_file(dir + "/" + name));
    json j;
    try {
      j = json::parse(text);
    } catch (const std::exception& ex) {
      return make_error(ErrorCode::kCorrupt, "{}/{}: {}", dir, name, ex.what());
    }
    ZINF_ASSIGN_OR_RETURN(ckpt::RankEntry entry, ckpt::rank_from_json(j, dir + "/" + name));
    m.ranks.push_back(std::move(entry));
  }
  ZINF_RETURN_IF_ERROR(
      ckpt::write_small_file(dir, ckpt::kManifestName, ckpt::to_json_text(m)).status());
  for (int r = 0; r < e.world; ++r) {
    (void)::unlink(fmt::format("{}/rank-{:05d}.json", dir, r).c_str());
  }
  return Status::ok();
}

// ---- load ---------------------------------------------------------------------------------------

// Where each element of the saved state is: the segments by (unit, kind), those of this rank
// first (a stage-0 checkpoint has every element on every rank).
class SegmentIndex {
 public:
  SegmentIndex(const ckpt::Manifest& m, int rank) {
    const int first = rank < m.world ? rank : 0;
    for (int k = 0; k < m.world; ++k) {
      const ckpt::RankEntry& r = m.ranks[(first + k) % m.world];
      for (const ckpt::SegmentEntry& s : r.segments) by_[{s.unit, s.kind}].push_back({&r, &s});
    }
  }
  struct Hit {
    const ckpt::RankEntry* rank;
    const ckpt::SegmentEntry* segment;
  };
  // A segment holding flat element `x` of the unit's `kind`, or none.
  std::optional<Hit> find(uint32_t unit, const std::string& kind, uint64_t x) const {
    auto it = by_.find({unit, kind});
    if (it == by_.end()) return std::nullopt;
    for (const Hit& h : it->second) {
      if (h.segment->flat_begin <= x && x < h.segment->flat_end) return h;
    }
    return std::nullopt;
  }

 private:
  std::map<std::pair<uint32_t, std::string>, std::vector<Hit>> by_;
};

class Loader {
 public:
  Loader(EngineState& e, const ckpt::Manifest& m, std::string dir)
      : e_(e), m_(m), dir_(std::move(dir)), index_(m, e.rank) {}

  // The saved units must be this engine's, parameter by parameter.
  Status check_compatible() const {
    if (m_.units.size() != e_.units.size()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "checkpoint {} holds {} units, the model has {}", dir_, m_.units.size(),
                        e_.units.size());
    }
    for (size_t u = 0; u < e_.units.size(); ++u) {
      const zero::ShardLayout& l = e_.unit_states[u].layout;
      const ckpt::UnitEntry& s = m_.units[u];
      bool same =
          s.name == e_.units[u].name && s.numel == l.numel && s.params.size() == l.params.size();
      for (size_t i = 0; same && i < l.params.size(); ++i) {
        same = s.params[i].name == l.params[i].name && s.params[i].offset == l.params[i].offset &&
               s.params[i].shape == e_.units[u].params[i].shape;
      }
      if (!same) {
        return make_error(ErrorCode::kInvalidArgument,
                          "checkpoint {}: unit {} ('{}', {} parameters) is not the model's unit "
                          "'{}' ({} parameters) with the same parameters and shapes",
                          dir_, u, s.name, s.numel, e_.units[u].name, l.numel);
      }
    }
    if (m_.dtype != e_.s.dtype) {
      return make_error(ErrorCode::kInvalidArgument,
                        "checkpoint {} was saved in {}; this run's dtype is {} (converting on "
                        "load is not supported)",
                        dir_, dtype_name(m_.dtype), dtype_name(e_.s.dtype));
    }
    return Status::ok();
  }

  // Pass 1 (nothing read): which files this rank needs, and that every element is there.
  // Pass 2: the reads.
  Status run(bool dry) {
    dry_ = dry;
    for (size_t u = 0; u < e_.unit_states.size(); ++u) {
      const UnitState& st = e_.unit_states[u];
      const uint64_t begin = e_.policy.param_begin(st.layout, e_.rank);
      ZINF_RETURN_IF_ERROR(load(ckpt::kParams, u, st.params, e_.s.param_home, begin,
                                begin + e_.policy.param_elements(st.layout), e_.s.dtype));
      for (size_t pi : st.pieces) {
        const PieceState& p = e_.pieces[pi];
        if (e_.mixed) {
          ZINF_RETURN_IF_ERROR(
              load(ckpt::kMaster, u, p.master, st.opt_home, p.begin, p.end, DType::kF32));
        }
        ZINF_RETURN_IF_ERROR(load(ckpt::kAdamM, u, p.m, st.opt_home, p.begin, p.end, DType::kF32));
        ZINF_RETURN_IF_ERROR(load(ckpt::kAdamV, u, p.v, st.opt_home, p.begin, p.end, DType::kF32));
      }
    }
    return Status::ok();
  }

  // The files pass 1 found, verified whole (size and XXH3) and opened for pass 2; and the files
  // of the saved ranks q with q % world == rank, so that every file of the checkpoint is verified
  // by some rank even where no rank reads it (a shard of padding only).
  Status verify_and_open() {
    std::map<std::string, const ckpt::FileDigest*> check = needed_;
    for (int q = e_.rank; q < m_.world; q += e_.world) {
      for (const ckpt::FileDigest& f : m_.ranks[q].files) check.emplace(f.name, &f);
    }
    for (const auto& [name, digest] : check) ZINF_RETURN_IF_ERROR(ckpt::verify_file(dir_, *digest));
    for (const auto& [name, digest] : needed_) {
      ZINF_ASSIGN_OR_RETURN(ckpt::ShardReader r, ckpt::ShardReader::open(dir_, *digest));
      readers_.emplace(name, std::move(r));
    }
    return Status::ok();
  }

 private:
  Status load(const char* kind, size_t u, TensorId id, Tier home, uint64_t begin, uint64_t end,
              DType dtype) {
    const uint64_t esize = dtype_size(dtype);
    const uint64_t numel = m_.units[u].numel;
    TensorHandle h;
    char* dst = nullptr;
    if (!dry_) {
      ZINF_ASSIGN_OR_RETURN(h, e_.store->acquire(id, Tier::kHost, Access::kOverwrite));
      dst = static_cast<char*>(h.data());
    }
    for (uint64_t x = begin; x < end;) {
      if (x >= numel) {  // the padding: zeros at every world size
        if (dst) std::memset(dst + (x - begin) * esize, 0, (end - x) * esize);
        break;
      }
      auto hit = index_.find(static_cast<uint32_t>(u), kind, x);
      if (!hit) {
        return make_error(ErrorCode::kCorrupt,
                          "checkpoint {} lacks element {} of unit {}'s {} (no segment holds it)",
                          dir_, x, e_.units[u].name, kind);
      }
      const ckpt::SegmentEntry& s = *hit->segment;
      if (s.dtype != dtype) {
        return make_error(ErrorCode::kCorrupt, "checkpoint {}: {} of unit {} in {} is {}, not {}",
                          dir_, kind, e_.units[u].name, s.file, dtype_name(s.dtype),
                          dtype_name(dtype));
      }
      const uint64_t n = std::min(s.flat_end, end) - x;
      if (dry_) {
        for (const ckpt::FileDigest& f : hit->rank->files) {
          if (f.name == s.file) needed_.emplace(f.name, &f);
        }
      } else {
        ZINF_RETURN_IF_ERROR(readers_.at(s.file).read_at(s.offset + (x - s.flat_begin) * esize,
                                                         dst + (x - begin) * esize, n * esize));
      }
      x += n;
    }
    if (dry_) return Status::ok();
    h.release();
    // Written back to its home (device or NVMe); the host copy is not kept.
    if (home != Tier::kHost) ZINF_RETURN_IF_ERROR(e_.store->evict(id, Tier::kHost));
    return Status::ok();
  }

  EngineState& e_;
  const ckpt::Manifest& m_;
  std::string dir_;
  SegmentIndex index_;
  bool dry_ = true;
  std::map<std::string, const ckpt::FileDigest*> needed_;
  std::map<std::string, ckpt::ShardReader> readers_;
};

}  // namespace

Result<std::string> save_checkpoint(EngineState& e, const json& scalars, const std::string& root,
                                    const SaveCheckpointOptions& options) {
  const int64_t step = options.step >= 0 ? options.step : e.steps;
  ZINF_RETURN_IF_ERROR(agree(e.comm, check_between_steps(e, "save_checkpoint"), "save_checkpoint"));
  // Every rank writes into rank 0's temporary directory (its pid in the name).
  uint64_t pid = static_cast<uint64_t>(::getpid());
  ZINF_RETURN_IF_ERROR(e.comm.broadcast_bytes(&pid, sizeof pid, 0).wait());
  std::string tmp = fmt::format("{}/tmp-{}-{}", root, step, pid);
  Status made;
  if (e.rank == 0) made = ckpt::create_temp_dir(root, step, pid).status();
  ZINF_RETURN_IF_ERROR(agree(e.comm, std::move(made), "creating the checkpoint directory"));

  Status written = Saver(e, tmp).write_all();
  Status all = agree(e.comm, std::move(written), "writing the checkpoint");
  Result<std::string> committed = make_error(ErrorCode::kInternal, "not committed");
  if (e.rank == 0) {
    Status st = all;
    if (st.is_ok()) st = write_manifest(e, tmp, step, scalars, options.user_state);
    if (st.is_ok()) {
      committed = ckpt::commit_dir(root, tmp, step);
      st = committed.status();
    }
    if (st.is_ok()) st = ckpt::prune(root, options.keep);
    if (!st.is_ok()) (void)ckpt::remove_tree(tmp);  // no partial state left behind
    all = std::move(st);
  }
  ZINF_RETURN_IF_ERROR(agree(e.comm, std::move(all), "committing the checkpoint"));
  e.comm.reset_counters();  // not part of the next step's report
  return fmt::format("{}/{}", root, ckpt::step_dir_name(step));
}

Result<LoadedState> load_checkpoint(EngineState& e, const std::string& path) {
  ZINF_RETURN_IF_ERROR(agree(e.comm, check_between_steps(e, "load_checkpoint"), "load_checkpoint"));
  Status local;
  ckpt::Manifest m;
  std::string dir;
  if (auto resolved = ckpt::resolve_checkpoint(path); resolved.is_ok()) {
    dir = *resolved;
    if (auto read = ckpt::read_manifest(dir); read.is_ok()) {
      m = std::move(*read);
    } else {
      local = read.status();
    }
  } else {
    local = resolved.status();
  }
  std::optional<Loader> loader;
  if (local.is_ok()) {
    loader.emplace(e, m, dir);
    local = loader->check_compatible();
  }
  if (local.is_ok()) local = loader->run(/*dry=*/true);
  if (local.is_ok()) local = loader->verify_and_open();
  ZINF_RETURN_IF_ERROR(agree(e.comm, std::move(local), "verifying the checkpoint"));
  // From here the engine's state is overwritten.
  Status loaded = loader->run(/*dry=*/false);
  if (!loaded.is_ok()) {
    loaded.with_context(fmt::format(
        "loading {} after it verified: this engine's state is partly overwritten and must not "
        "be used",
        dir));
  }
  ZINF_RETURN_IF_ERROR(agree(e.comm, std::move(loaded), "loading the checkpoint"));
  for (UnitState& st : e.unit_states) st.acc_zero = true;
  e.comm.reset_counters();
  LoadedState out;
  out.info.path = dir;
  out.info.step = m.step;
  out.info.user_state = m.user.dump();
  out.scalars = std::move(m.engine);
  return out;
}

}  // namespace zinf::engine_detail
