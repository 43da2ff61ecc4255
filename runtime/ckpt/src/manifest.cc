#include "zinf/ckpt/manifest.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

namespace zinf::ckpt {
namespace {

using nlohmann::json;

// The value `v` of `key` as a T, or an exception naming the key (parse_manifest's catch turns it
// into kCorrupt) unless it is an integer that T holds: nlohmann's get<T>() would wrap -1 or 2^32
// into range and truncate 6.5, so a manifest could say one thing and be read as another.
template <class T>
T integer(const json& v, std::string_view key) {
  using Limits = std::numeric_limits<T>;
  if (v.is_number_unsigned()) {
    const uint64_t x = v.get<uint64_t>();
    if (x <= static_cast<uint64_t>(Limits::max())) return static_cast<T>(x);
  } else if (v.is_number_integer() && std::is_signed_v<T>) {
    const int64_t x = v.get<int64_t>();  // negative: non-negative integers parse as unsigned
    if (x >= static_cast<int64_t>(Limits::min())) return static_cast<T>(x);
  }
  throw std::out_of_range(fmt::format("'{}' is {}, not an integer in [{}, {}]", key, v.dump(),
                                      Limits::min(), Limits::max()));
}

template <class T>
T integer_at(const json& j, const char* key) {
  return integer<T>(j.at(key), key);
}

// A checksum as file_json writes it: 16 lowercase hex digits (std::stoull alone would take "-1",
// "0x12" or "12zz").
uint64_t xxh3_from_hex(const std::string& hex, const std::string& file) {
  if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
    throw std::invalid_argument(
        fmt::format("'xxh3' of file '{}' is '{}', not 16 lowercase hex digits", file, hex));
  }
  return std::stoull(hex, nullptr, 16);
}

// The unit's own invariants, which the exporter relies on: it reads [offset, offset + numel) of
// the unit's flat buffer for each parameter and writes that many elements under its shape and
// name. A message, or empty.
std::string unit_problem(const UnitEntry& u) {
  if (u.numel > u.numel_padded) {
    return fmt::format("unit '{}' has 'numel' {} past its 'numel_padded' {}", u.name, u.numel,
                       u.numel_padded);
  }
  std::set<std::string> names;
  for (const ParamEntry& p : u.params) {
    if (!names.insert(p.name).second) {
      return fmt::format("unit '{}' lists a parameter '{}' twice in 'params'", u.name, p.name);
    }
    if (p.offset > u.numel || p.numel > u.numel - p.offset) {
      return fmt::format(
          "unit '{}': 'params' entry '{}' ({} elements at offset {}) lies past "
          "the unit's {} elements",
          u.name, p.name, p.numel, p.offset, u.numel);
    }
    uint64_t product = 1;
    bool fits = true;
    for (int64_t d : p.shape) {
      const uint64_t n = static_cast<uint64_t>(d);
      fits = fits && d > 0 && product <= std::numeric_limits<uint64_t>::max() / n;
      if (fits) product *= n;
    }
    if (!fits || product != p.numel) {
      return fmt::format(
          "unit '{}': the 'shape' [{}] of parameter '{}' does not hold its {} elements", u.name,
          fmt::join(p.shape, ", "), p.name, p.numel);
    }
  }
  return {};
}

json file_json(const FileDigest& f) {
  return {{"name", f.name}, {"bytes", f.bytes}, {"xxh3", fmt::format("{:016x}", f.xxh3)}};
}

}  // namespace

int json_depth(const json& j) {
  int deepest = 0;
  std::vector<std::pair<const json*, int>> todo{{&j, 1}};
  while (!todo.empty()) {
    const auto [v, depth] = todo.back();
    todo.pop_back();
    deepest = std::max(deepest, depth);
    if (v->is_structured()) {
      for (const json& child : *v) todo.push_back({&child, depth + 1});
    }
  }
  return deepest;
}

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
    r.rank = integer_at<int>(j, "rank");
    std::map<std::string, uint64_t> sizes;
    for (const json& f : j.at("files")) {
      FileDigest d{.name = f.at("name").get<std::string>(),
                   .bytes = integer_at<uint64_t>(f, "bytes")};
      // A NUL would end the name where open(2) reads it: another file than the one named.
      if (d.name.empty() || d.name.find_first_of(std::string("/\0", 2)) != std::string::npos ||
          d.name[0] == '.') {
        return make_error(ErrorCode::kCorrupt, "{}: rank {} names a file {} outside the directory",
                          where, r.rank, json(d.name).dump());  // quoted, a NUL escaped
      }
      d.xxh3 = xxh3_from_hex(f.at("xxh3").get<std::string>(), d.name);
      // Loaders open a file by its name: two entries would check a segment against one and read
      // it through the other.
      if (!sizes.emplace(d.name, d.bytes).second) {
        return make_error(ErrorCode::kCorrupt, "{}: rank {} lists the file '{}' twice in 'files'",
                          where, r.rank, d.name);
      }
      r.files.push_back(std::move(d));
    }
    for (const json& s : j.at("segments")) {
      SegmentEntry e{.unit = integer_at<uint32_t>(s, "unit"),
                     .kind = s.at("kind").get<std::string>(),
                     .flat_begin = integer_at<uint64_t>(s, "flat_begin"),
                     .flat_end = integer_at<uint64_t>(s, "flat_end"),
                     .file = s.at("file").get<std::string>(),
                     .offset = integer_at<uint64_t>(s, "offset")};
      auto dt = parse_dtype(s.at("dtype").get<std::string>());
      if (!dt) return make_error(ErrorCode::kCorrupt, "{}: a segment has an unknown dtype", where);
      e.dtype = *dt;
      // [offset, offset + elements * size) inside the file, computed without wrapping around.
      auto it = sizes.find(e.file);
      const uint64_t elements = e.flat_end - e.flat_begin, esize = dtype_size(e.dtype);
      const bool inside = e.flat_begin <= e.flat_end && it != sizes.end() &&
                          elements <= std::numeric_limits<uint64_t>::max() / esize &&
                          e.offset <= it->second && elements * esize <= it->second - e.offset;
      if (!inside) {
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
    m.format_version = integer_at<int>(j, "format_version");
    if (m.format_version != kFormatVersion) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: checkpoint format version {}, this zinf reads version {}", path,
                        m.format_version, kFormatVersion);
    }
    m.step = integer_at<int64_t>(j, "step");
    m.world = integer_at<int>(j, "world_size");
    m.stage = integer_at<int>(j, "stage");
    auto dt = parse_dtype(j.at("dtype").get<std::string>());
    if (!dt) return make_error(ErrorCode::kCorrupt, "{}: unknown dtype", path);
    m.dtype = *dt;
    m.mixed = j.at("mixed").get<bool>();
    m.param_home = j.at("param_home").get<std::string>();
    m.optimizer_home = j.at("optimizer_home").get<std::string>();
    for (const json& u : j.at("units")) {
      UnitEntry e{.name = u.at("name").get<std::string>(),
                  .numel = integer_at<uint64_t>(u, "numel"),
                  .numel_padded = integer_at<uint64_t>(u, "numel_padded"),
                  .shard_numel = integer_at<uint64_t>(u, "shard_numel")};
      for (const json& p : u.at("params")) {
        ParamEntry pe{.name = p.at("name").get<std::string>(),
                      .offset = integer_at<uint64_t>(p, "offset"),
                      .numel = integer_at<uint64_t>(p, "numel")};
        for (const json& d : p.at("shape")) pe.shape.push_back(integer<int64_t>(d, "shape"));
        e.params.push_back(std::move(pe));
      }
      if (std::string problem = unit_problem(e); !problem.empty()) {
        return make_error(ErrorCode::kCorrupt, "{}: {}", path, problem);
      }
      m.units.push_back(std::move(e));
    }
    for (const char* key : {"engine", "user"}) {
      if (const int depth = json_depth(j.at(key)); depth > kMaxStateDepth) {
        return make_error(ErrorCode::kCorrupt, "{}: '{}' nests {} levels deep, more than {}", path,
                          key, depth, kMaxStateDepth);
      }
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
  std::set<std::string> files;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    const RankEntry& r = m.ranks[i];
    // Loaders take ranks[q] as saved rank q.
    if (r.rank != static_cast<int>(i)) {
      return make_error(ErrorCode::kCorrupt, "{}: 'ranks' lists rank {} at position {}", path,
                        r.rank, i);
    }
    for (const FileDigest& f : r.files) {
      // The loader and the exporter key open files by name, across ranks.
      if (!files.insert(f.name).second) {
        return make_error(ErrorCode::kCorrupt,
                          "{}: the file '{}' is listed twice in 'files' (again by rank {})", path,
                          f.name, r.rank);
      }
      if (f.bytes > std::numeric_limits<uint64_t>::max() - total_bytes) {
        return make_error(ErrorCode::kCorrupt, "{}: the files' 'bytes' add up past 2^64", path);
      }
      total_bytes += f.bytes;
    }
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
