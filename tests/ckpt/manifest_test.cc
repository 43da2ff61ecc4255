// The manifest reader alone (zinf::ckpt::parse_manifest), without an engine: a manifest the
// writer makes parses back to the same text; each invariant the loader and the exporter rely on
// (a segment's bytes inside its file, file names that key one file, a parameter inside its unit
// with its shape's element count, integers that fit their field) is refused, naming the key, when
// a manifest breaks it. tests/fuzz/ckpt_manifest.cc states the same properties over arbitrary text.
#include "zinf/ckpt/manifest.h"

#include <gtest/gtest.h>

#include <string>

namespace zinf::ckpt {
namespace {

using nlohmann::json;

constexpr const char* kPath = "ckpt/step-7/manifest.json";

// World 2, stage 3, fp32: one unit of 6 elements (w [2, 2], b [2]) padded to 8, each rank holding
// 4 of them, of params, adam_m and adam_v, in its own files.
Manifest two_ranks() {
  Manifest m{.step = 7,
             .world = 2,
             .stage = 3,
             .param_home = "none",
             .optimizer_home = "cpu",
             .units = {{.name = "layer0",
                        .numel = 6,
                        .numel_padded = 8,
                        .shard_numel = 4,
                        .params = {{.name = "w", .shape = {2, 2}, .offset = 0, .numel = 4},
                                   {.name = "b", .shape = {2}, .offset = 4, .numel = 2}}}},
             .engine = {{"optimizer_steps", 7}, {"loss_scale", 1.0}},
             .user = {{"trainer_step", 7}, {"seed", 1234}}};
  for (int r = 0; r < 2; ++r) {
    RankEntry e{.rank = r};
    for (const char* kind : {kParams, kAdamM, kAdamV}) {
      const std::string file = fmt::format("rank-{:05d}.{}.bin", r, kind);
      e.files.push_back({.name = file, .bytes = 16, .xxh3 = 0x0123456789abcdefull + r});
      e.segments.push_back({.unit = 0,
                            .kind = kind,
                            .flat_begin = 4ull * r,
                            .flat_end = 4ull * r + 4,
                            .dtype = DType::kF32,
                            .file = file,
                            .offset = 0});
    }
    m.ranks.push_back(std::move(e));
  }
  return m;
}

json two_ranks_json() { return json::parse(to_json_text(two_ranks())); }

// The manifest `j` refused as corrupt, with `path` and every one of `words` in the message.
void expect_refused(const json& j, std::initializer_list<const char*> words) {
  Result<Manifest> m = parse_manifest(j.dump(), kPath);
  ASSERT_FALSE(m.is_ok()) << j.dump(1);
  EXPECT_EQ(m.status().code(), ErrorCode::kCorrupt) << m.status().detail();
  EXPECT_NE(m.status().message().find(kPath), std::string::npos) << m.status().message();
  for (const char* w : words) {
    EXPECT_NE(m.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << m.status().message();
  }
}

TEST(Manifest, AWrittenManifestParsesBackToTheSameText) {
  const std::string text = to_json_text(two_ranks());
  Result<Manifest> m = parse_manifest(text, kPath);
  ASSERT_TRUE(m.is_ok()) << m.status().detail();
  EXPECT_EQ(to_json_text(*m), text);
  EXPECT_EQ(m->ranks[1].segments[2].kind, kAdamV);
  EXPECT_EQ(m->ranks[1].files[0].xxh3, 0x0123456789abcdf0ull);
  EXPECT_EQ(m->total_bytes(), 6u * 16);
}

TEST(Manifest, AnIntegerItsFieldCannotHoldIsRefusedNotWrapped) {
  {  // was read as unit 0
    json j = two_ranks_json();
    j["ranks"][0]["segments"][0]["unit"] = 4294967296ull;
    expect_refused(j, {"'unit'", "4294967296"});
  }
  {  // was read as 2^64 - 1
    json j = two_ranks_json();
    j["ranks"][1]["files"][0]["bytes"] = -1;
    expect_refused(j, {"'bytes'", "-1"});
  }
  {  // was truncated to 6
    json j = two_ranks_json();
    j["units"][0]["numel"] = 6.5;
    expect_refused(j, {"'numel'", "6.5"});
  }
  {  // was read as world size 2
    json j = two_ranks_json();
    j["world_size"] = 4294967298ull;
    expect_refused(j, {"'world_size'"});
  }
  {  // was read as rank 0
    json j = two_ranks_json();
    j["ranks"][0]["rank"] = -4294967296ll;
    expect_refused(j, {"'rank'"});
  }
  {
    json j = two_ranks_json();
    j["units"][0]["params"][0]["shape"] = {2, 2.5};
    expect_refused(j, {"'shape'"});
  }
}

TEST(Manifest, AChecksumIsSixteenHexDigits) {
  for (const char* xxh3 : {"-1", "0x0123456789abcd", "123", "0123456789ABCDEF", "0123456789abcdefg",
                           " 123456789abcdef"}) {
    json j = two_ranks_json();
    j["ranks"][0]["files"][1]["xxh3"] = xxh3;
    expect_refused(j, {"'xxh3'", "rank-00000.adam_m.bin"});
  }
}

TEST(Manifest, ASegmentWhoseByteRangeWrapsAroundIsRefused) {
  {  // offset + 16 bytes wraps to 8: was accepted, in a 16-byte file
    json j = two_ranks_json();
    j["ranks"][0]["segments"][0]["offset"] = ~uint64_t{0} - 7;
    expect_refused(j, {"rank 0", "params", "rank-00000.params.bin"});
  }
  {  // (2^62 elements) * 4 bytes wraps to 0: was accepted
    json j = two_ranks_json();
    j["units"][0]["numel_padded"] = uint64_t{1} << 62;
    j["ranks"][1]["segments"][1]["flat_begin"] = 0;
    j["ranks"][1]["segments"][1]["flat_end"] = uint64_t{1} << 62;
    expect_refused(j, {"rank 1", "adam_m", "rank-00001.adam_m.bin"});
  }
  {
    json j = two_ranks_json();
    j["ranks"][0]["segments"][2]["flat_begin"] = 4;
    j["ranks"][0]["segments"][2]["flat_end"] = 2;
    expect_refused(j, {"rank 0", "adam_v", "[4, 2)"});
  }
}

// The loader and the exporter open a file by its name: a name listed twice, with another size,
// would have a segment checked against one entry and read through the other (past its end, after
// the engine's state was partly overwritten).
TEST(Manifest, AFileNamedTwiceIsRefused) {
  {
    json j = two_ranks_json();
    j["ranks"][0]["files"].push_back(
        {{"name", "rank-00000.params.bin"}, {"bytes", 4096}, {"xxh3", "0000000000000000"}});
    expect_refused(j, {"'files'", "rank-00000.params.bin", "twice"});
  }
  {
    json j = two_ranks_json();
    j["ranks"][1]["files"][0]["name"] = "rank-00000.params.bin";
    j["ranks"][1]["segments"][0]["file"] = "rank-00000.params.bin";
    expect_refused(j, {"'files'", "rank-00000.params.bin", "twice"});
  }
  {
    json j = two_ranks_json();
    const std::string nul("rank-00001.params.bin\0x", 23);  // opened as rank-00001.params.bin
    j["ranks"][1]["files"][0]["name"] = nul;
    j["ranks"][1]["segments"][0]["file"] = nul;
    expect_refused(j, {"outside the directory", "\"rank-00001.params.bin\\u0000x\""});
  }
}

TEST(Manifest, RanksAreListedInOrder) {
  json j = two_ranks_json();
  std::swap(j["ranks"][0], j["ranks"][1]);
  expect_refused(j, {"'ranks'", "rank 1", "position 0"});
}

// The exporter reads [offset, offset + numel) of the unit for a parameter and writes it under its
// shape; a parameter outside its unit or with another element count made a wrong file silently.
TEST(Manifest, AParameterLiesInsideItsUnitAndHoldsItsShapesElements) {
  {
    json j = two_ranks_json();
    j["units"][0]["params"][1]["offset"] = 5;
    expect_refused(j, {"'params'", "'b'", "layer0"});
  }
  {  // offset + numel wraps to 1
    json j = two_ranks_json();
    j["units"][0]["params"][1]["offset"] = ~uint64_t{0};
    expect_refused(j, {"'params'", "'b'", "layer0"});
  }
  {
    json j = two_ranks_json();
    j["units"][0]["params"][0]["shape"] = {3, 2};
    expect_refused(j, {"'shape'", "'w'", "layer0"});
  }
  {
    json j = two_ranks_json();
    j["units"][0]["params"][0]["shape"] = {-2, -2};
    expect_refused(j, {"'shape'", "'w'"});
  }
  {  // 2^32 * 2^32 wraps to 0
    json j = two_ranks_json();
    j["units"][0]["params"][0]["shape"] = {uint64_t{1} << 32, uint64_t{1} << 32};
    j["units"][0]["params"][0]["numel"] = 0;
    expect_refused(j, {"'shape'", "'w'"});
  }
  {
    json j = two_ranks_json();
    j["units"][0]["params"][1]["name"] = "w";
    expect_refused(j, {"'params'", "'w'", "twice"});
  }
  {
    json j = two_ranks_json();
    j["units"][0]["numel"] = 9;
    expect_refused(j, {"'numel'", "layer0", "numel_padded"});
  }
}

// Copying or writing JSON recurses once per level: a 2 MB manifest whose `user` nested a million
// levels deep crashed the reader with a stack overflow.
TEST(Manifest, StateNestedTooDeeplyIsRefusedNotAStackOverflow) {
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  for (const char* key : {"user", "engine"}) {
    std::string text = two_ranks_json().dump();
    const std::string at = fmt::format("\"{}\":{{", key);
    ASSERT_NE(text.find(at), std::string::npos);
    text.insert(text.find(at) + at.size(), "\"deep\":" + deep + ",");
    Result<Manifest> m = parse_manifest(text, kPath);
    ASSERT_FALSE(m.is_ok());
    EXPECT_EQ(m.status().code(), ErrorCode::kCorrupt);
    EXPECT_NE(m.status().message().find(fmt::format("'{}' nests 1000001 levels", key)),
              std::string::npos)
        << m.status().message();
  }
  json j = two_ranks_json();
  json nested = json::array();
  for (int level = 2; level < kMaxStateDepth; ++level) nested = json::array({nested});
  j["user"] = {{"nested", nested}};
  ASSERT_EQ(json_depth(j["user"]), kMaxStateDepth);
  EXPECT_TRUE(parse_manifest(j.dump(), kPath).is_ok());
  j["user"] = {{"nested", json::array({nested})}};
  expect_refused(j, {"'user'", "65 levels"});
}

}  // namespace
}  // namespace zinf::ckpt
