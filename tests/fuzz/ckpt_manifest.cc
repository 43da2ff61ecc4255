// The checkpoint manifest reader (zinf::ckpt::parse_manifest) on arbitrary text. Properties: it
// returns a Manifest or a kCorrupt (kInvalidArgument for another format version) error naming the
// path, and never crashes, throws or runs away with memory; a manifest it accepts
//  - keeps every invariant manifest.h promises, checked here again with checked arithmetic;
//  - says what the input said: each key to_json_text writes has the input's value there (no
//    integer wrapped or truncated into range on the way, no checksum respelled);
//  - parses back from to_json_text to a manifest that writes the same text again.
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "zinf/ckpt/manifest.h"

namespace {

using nlohmann::json;
using namespace zinf::ckpt;

constexpr const char* kPath = "fuzz/step-1/manifest.json";

// Whether every key of `out` (what the writer wrote) has the same value in `in` (the input), which
// may hold more keys. Dtypes compare by meaning: the reader takes "float32" for "fp32".
bool says_the_same(const json& in, const json& out, std::string_view key) {
  if (key == "dtype") {
    return in.is_string() && out.is_string() &&
           zinf::parse_dtype(in.get<std::string>()) == zinf::parse_dtype(out.get<std::string>());
  }
  if (key == "engine" || key == "user") return in == out;  // stored as given
  if (out.is_object()) {
    if (!in.is_object()) return false;
    for (const auto& [k, v] : out.items()) {
      if (!in.contains(k) || !says_the_same(in.at(k), v, k)) return false;
    }
    return true;
  }
  if (out.is_array()) {
    if (!in.is_array() || in.size() != out.size()) return false;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!says_the_same(in[i], out[i], key)) return false;
    }
    return true;
  }
  return in == out;
}

void check_invariants(const Manifest& m) {
  FUZZ_CHECK(m.format_version == kFormatVersion);
  FUZZ_CHECK(m.world >= 1);
  FUZZ_CHECK(m.ranks.size() == static_cast<size_t>(m.world));
  for (const UnitEntry& u : m.units) {
    FUZZ_CHECK(u.numel <= u.numel_padded);
    std::set<std::string> names;
    for (const ParamEntry& p : u.params) {
      FUZZ_CHECK(names.insert(p.name).second);
      uint64_t end = 0;
      FUZZ_CHECK(!__builtin_add_overflow(p.offset, p.numel, &end));
      FUZZ_CHECK(end <= u.numel);
      uint64_t product = 1;
      for (int64_t d : p.shape) {
        FUZZ_CHECK(d > 0);
        FUZZ_CHECK(!__builtin_mul_overflow(product, static_cast<uint64_t>(d), &product));
      }
      FUZZ_CHECK(product == p.numel);
    }
  }
  std::set<std::string> files;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    const RankEntry& r = m.ranks[i];
    FUZZ_CHECK(r.rank == static_cast<int>(i));
    for (const zinf::ckpt::FileDigest& f : r.files) {
      FUZZ_CHECK(!f.name.empty() && f.name[0] != '.');
      FUZZ_CHECK(f.name.find('/') == std::string::npos);
      FUZZ_CHECK(f.name.find('\0') == std::string::npos);
      FUZZ_CHECK(files.insert(f.name).second);
      FUZZ_CHECK(!__builtin_add_overflow(total_bytes, f.bytes, &total_bytes));
    }
    for (const SegmentEntry& s : r.segments) {
      FUZZ_CHECK(s.unit < m.units.size());
      FUZZ_CHECK(s.flat_begin <= s.flat_end);
      FUZZ_CHECK(s.flat_end <= m.units[s.unit].numel_padded);
      const zinf::ckpt::FileDigest* file = nullptr;
      for (const zinf::ckpt::FileDigest& f : r.files) {
        if (f.name == s.file) file = &f;
      }
      FUZZ_CHECK(file != nullptr);  // a file of the segment's own rank
      uint64_t bytes = 0, end = 0;
      FUZZ_CHECK(
          !__builtin_mul_overflow(s.flat_end - s.flat_begin, zinf::dtype_size(s.dtype), &bytes));
      FUZZ_CHECK(!__builtin_add_overflow(s.offset, bytes, &end));
      FUZZ_CHECK(end <= file->bytes);
    }
  }
  FUZZ_CHECK(m.total_bytes() == total_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  zinf::Result<Manifest> m = parse_manifest(text, kPath);
  if (!m.is_ok()) {
    const zinf::ErrorCode code = m.status().code();
    FUZZ_CHECK(code == zinf::ErrorCode::kCorrupt || code == zinf::ErrorCode::kInvalidArgument);
    FUZZ_CHECK(m.status().message().find(kPath) != std::string::npos);
    return 0;
  }
  check_invariants(*m);
  const std::string written = to_json_text(*m);
  FUZZ_CHECK(says_the_same(json::parse(text), json::parse(written), ""));
  zinf::Result<Manifest> again = parse_manifest(written, kPath);
  FUZZ_CHECK(again.is_ok());
  FUZZ_CHECK(to_json_text(*again) == written);
  return 0;
}
