// The manifest of a checkpoint (manifest.json in its directory): what was saved and where.
//
// A segment is a range [flat_begin, flat_end) of one unit's flat buffer (zinf/zero/shard_layout.h)
// for one kind of state, stored contiguously in one file at `offset`. The flat index of a real
// element is the same at every world size (only the padding past `numel` differs), so a loader
// at any world size or stage finds each element it needs in the segments, whichever rank wrote
// them. Stage 0 ranks each hold every shard: their segments overlap, and any one serves.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "zinf/ckpt/files.h"
#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf::ckpt {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";

// The kinds of state a segment holds.
inline constexpr const char* kParams = "params";  // the working dtype
inline constexpr const char* kMaster = "master";  // fp32 master (mixed precision only)
inline constexpr const char* kAdamM = "adam_m";   // fp32
inline constexpr const char* kAdamV = "adam_v";   // fp32

struct ParamEntry {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // flat element index
  uint64_t numel = 0;
};

struct UnitEntry {
  std::string name;
  uint64_t numel = 0;
  uint64_t numel_padded = 0;  // at the saving world size
  uint64_t shard_numel = 0;
  std::vector<ParamEntry> params;
};

struct SegmentEntry {
  uint32_t unit = 0;
  std::string kind;  // kParams, kMaster, kAdamM, kAdamV
  uint64_t flat_begin = 0, flat_end = 0;
  DType dtype = DType::kF32;
  std::string file;
  uint64_t offset = 0;  // bytes into the file
};

struct RankEntry {
  int rank = 0;
  std::vector<FileDigest> files;
  std::vector<SegmentEntry> segments;
};

struct Manifest {
  int format_version = kFormatVersion;
  int64_t step = 0;  // the caller's step label (the directory's name: step-<step>)
  int world = 1;
  int stage = 0;
  DType dtype = DType::kF32;  // working dtype
  bool mixed = false;         // a separate fp32 master was saved
  std::string param_home, optimizer_home;
  std::vector<UnitEntry> units;
  // The engine's scalar state (optimizer step, loss scale and its counters) and the caller's
  // own (data position, seeds, schedule): JSON objects stored as given.
  nlohmann::json engine = nlohmann::json::object();
  nlohmann::json user = nlohmann::json::object();
  std::vector<RankEntry> ranks;

  uint64_t total_bytes() const;
};

// The deepest nesting `engine` and `user` may have (a scalar is 1 level, `{"a": 1}` 2): copying
// or writing JSON recurses once per level, so parse_manifest refuses deeper state (kCorrupt)
// instead of overflowing its stack, and save_checkpoint refuses to write it.
inline constexpr int kMaxStateDepth = 64;
// The nesting depth of `j`, found without recursion.
int json_depth(const nlohmann::json& j);

nlohmann::json to_json(const RankEntry& r);
Result<RankEntry> rank_from_json(const nlohmann::json& j, const std::string& where);
std::string to_json_text(const Manifest& m);
// Parses and checks a manifest: kCorrupt naming `path` (and the key, where one is at fault) for
// bad JSON, a missing key or an inconsistent entry. What it accepts, loaders may rely on:
//  - every integer is one its field holds (no value wrapped or truncated into range), and each
//    checksum is 16 lowercase hex digits, so to_json_text() writes back what was read;
//  - ranks[i].rank == i, world_size ranks, and file names, free of '/' and NUL and not starting
//    with '.', that are distinct across all ranks (loaders open files by name), whose bytes add up
//    within 64 bits;
//  - each segment names a unit and a file of its own rank, flat_begin <= flat_end <= the unit's
//    numel_padded, and its bytes lie inside the file (computed without wrapping around);
//  - in each unit numel <= numel_padded, and its parameters have distinct names, lie inside
//    [0, numel) and have shapes of positive dimensions whose product is their numel;
//  - `engine` and `user` nest at most kMaxStateDepth levels.
Result<Manifest> parse_manifest(const std::string& text, const std::string& path);
Result<Manifest> read_manifest(const std::string& dir);

// Every file of every rank checked for size and XXH3 (verify_file).
Status verify_all(const std::string& dir, const Manifest& m);

}  // namespace zinf::ckpt
