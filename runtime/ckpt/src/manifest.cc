#include "zinf/ckpt/manifest.h"

#include <map>

namespace zinf::ckpt {
namespace {

using nlohmann::json;

json file_json(const FileDigest& f) {
  return {{"name", f.name}, {"bytes", f.bytes}, {"xxh3", fmt::format("{:016x}", f.xxh3)}};
}

}  // namespace

uint64_t Manifest::total_bytes() const {
  uint64_t n = 0;
  for (const RankEntry& r : ranks) {
    for (const FileDigest& f : r.files) n += f.bytes;
  }
  return n;
}

json to_json(const RankEntry& r) {
  json files = json::array(), segments = json::array();
  for (const FileDigest& f : r.files) files.push_back(file_json(f));
  for (const SegmentEntry& s : r.segments) {
    segments.push_back({{"unit", s.unit},
                        {"kind", s.kind},
                        {"flat_begin", s.flat_begin},
                        {"flat_end", s.flat_end},
                        {"dtype", dtype_name(s.dtype)},
                        {"file", s.file},
                        {"offset", s.offset}});
  }
  return {{"rank", r.rank}, {"files", files}, {"segments", segments}};
}

Result<RankEntry> rank_from_json(const json& j, const std::string& where) {
  try {
    RankEntry r;
    r.rank = j.at("rank").get<int>();
    std::map<std::string, uint64_t> sizes;
    for (const json& f : j.at("files")) {
      FileDigest d{.name = f.at("name").get<std::string>(), .bytes = f.at("bytes").get<uint64_t>()};
      const std::string hex = f.at("xxh3").get<std::string>();
      d.xxh3 = std::stoull(hex, nullptr, 16);
      if (d.name.empty() || d.name.find('/') != std::string::npos || d.name[0] == '.') {
        return make_error(ErrorCode::kCorrupt,
                          "{}: rank {} names a file '{}' outside the directory", where, r.rank,
                          d.name);
      }
      sizes[d.name] = d.bytes;
      r.files.push_back(std::move(d));
    }
    for (const json& s : j.at("segments")) {
      SegmentEntry e{.unit = s.at("unit").get<uint32_t>(),
                     .kind = s.at("kind").get<std::string>(),
                     .flat_begin = s.at("flat_begin").get<uint64_t>(),
                     .flat_end = s.at("flat_end").get<uint64_t>(),
                     .file = s.at("file").get<std::string>(),
                     .offset = s.at("offset").get<uint64_t>()};
      auto dt = parse_dtype(s.at("dtype").get<std::string>());
      if (!dt) return make_error(ErrorCode::kCorrupt, "{}: a segment has an unknown dtype", where);
      e.dtype = *dt;
      auto it = sizes.find(e.file);
      const uint64_t bytes = (e.flat_end - e.flat_begin) * dtype_size(e.dtype);
      if (e.flat_end < e.flat_begin || it == sizes.end() || e.offset + bytes > it->second) {
        return make_error(ErrorCode::kCorrupt,
                          "{}: rank {}'s {} segment of unit {} [{}, {}) does not lie in a listed "
                          "file ({} at offset {})",
                          where, r.rank, e.kind, e.unit, e.flat_begin, e.flat_end, e.file,
                          e.offset);
      }
      r.segments.push_back(std::move(e));
    }
    return r;
  } catch (const std::exception& ex) {
    return make_error(ErrorCode::kCorrupt, "{}: {}", where, ex.what());
  }
}

std::string to_json_text(const Manifest& m) {
  json units = json::array();
  for (const UnitEntry& u : m.units) {
    json params = json::array();
    for (const ParamEntry& p : u.params) {
      params.push_back(
          {{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"numel", p.numel}});
    }
    units.push_back({{"name", u.name},
                     {"numel", u.numel},
                     {"numel_padded", u.numel_padded},
                     {"shard_numel", u.shard_numel},
                     {"params", params}});
  }
  json ranks = json::array();
  for (const RankEntry& r : m.ranks) ranks.push_back(to_json(r));
  json j = {{"format", "zinf-checkpoint"},
            {"format_version", m.format_version},
            {"step", m.step},
            {"world_size", m.world},
            {"stage", m.stage},
            {"dtype", dtype_name(m.dtype)},
            {"mixed", m.mixed},
            {"param_home", m.param_home},
            {"optimizer_home", m.optimizer_home},
            {"units", units},
            {"engine", m.engine},
            {"user", m.user},
            {"ranks", ranks}};
  return j.dump(1) + "\n";
}

Result<Manifest> parse_manifest(const std::string& text, const std::string& path) {
  Manifest m;
  try {
    const json j = json::parse(text);
    if (j.at("format").get<std::string>() != "zinf-checkpoint") {
      return make_error(ErrorCode::kCorrupt, "{} is not a zinf checkpoint manifest", path);
    }
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version != kFormatVersion) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: checkpoint format version {}, this zinf reads version {}", path,
                        m.format_version, kFormatVersion);
    }
    m.step = j.at("step").get<int64_t>();
    m.world = j.at("world_size").get<int>();
    m.stage = j.at("stage").get<int>();
    auto dt = parse_dtype(j.at("dtype").get<std::string>());
    if (!dt) return make_error(ErrorCode::kCorrupt, "{}: unknown dtype", path);
    m.dtype = *dt;
    m.mixed = j.at("mixed").get<bool>();
    m.param_home = j.at("param_home").get<std::string>();
    m.optimizer_home = j.at("optimizer_home").get<std::string>();
    for (const json& u : j.at("units")) {
      UnitEntry e{.name = u.at("name").get<std::string>(),
                  .numel = u.at("numel").get<uint64_t>(),
                  .numel_padded = u.at("numel_padded").get<uint64_t>(),
                  .shard_numel = u.at("shard_numel").get<uint64_t>()};
      for (const json& p : u.at("params")) {
        e.params.push_back({.name = p.at("name").get<std::string>(),
                            .shape = p.at("shape").get<std::vector<int64_t>>(),
                            .offset = p.at("offset").get<uint64_t>(),
                            .numel = p.at("numel").get<uint64_t>()});
      }
      m.units.push_back(std::move(e));
    }
    m.engine = j.at("engine");
    m.user = j.at("user");
    for (const json& r : j.at("ranks")) {
      ZINF_ASSIGN_OR_RETURN(RankEntry e, rank_from_json(r, path));
      m.ranks.push_back(std::move(e));
    }
  } catch (const std::exception& ex) {
    return make_error(ErrorCode::kCorrupt, "{} is not a valid manifest: {}", path, ex.what());
  }
  if (m.world < 1 || static_cast<int>(m.ranks.size()) != m.world) {
    return make_error(ErrorCode::kCorrupt, "{}: world size {} but {} ranks listed", path, m.world,
                      m.ranks.size());
  }
  for (const RankEntry& r : m.ranks) {
    for (const SegmentEntry& s : r.segments) {
      if (s.unit >= m.units.size() || s.flat_end > m.units[s.unit].numel_padded) {
        return make_error(ErrorCode::kCorrupt, "{}: rank {} has a segment of unit {} out of range",
                          path, r.rank, s.unit);
      }
    }
  }
  return m;
}

Result<Manifest> read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifestName;
  ZINF_ASSIGN_OR_RETURN(std::string text, read_small_file(path));
  return parse_manifest(text, path);
}

Status verify_all(const std::string& dir, const Manifest& m) {
  for (const RankEntry& r : m.ranks) {
    for (const FileDigest& f : r.files) ZINF_RETURN_IF_ERROR(verify_file(dir, f));
  }
  return Status::ok();
}

}  // namespace zinf::ckpt
