// safetensors: what the writer writes the reader reads back bit for bit; tensor lists that would
// make a file lie about its contents are refused before anything is written (the writer used to
// throw on a name that is not UTF-8 and silently wrote a wrong header for the others); the reader
// refuses files whose header does not describe their bytes. tests/fuzz drives both with
// arbitrary input.
#include "zinf/gpt/safetensors.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "../io/test_dir.h"

namespace zinf::gpt {
namespace {

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<uint8_t> file_of(const std::string& header, const std::vector<float>& data) {
  std::vector<uint8_t> out(8);
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out.insert(out.end(), header.begin(), header.end());
  const auto* raw = reinterpret_cast<const uint8_t*>(data.data());
  out.insert(out.end(), raw, raw + data.size() * 4);
  return out;
}

TEST(Safetensors, WhatIsWrittenReadsBackBitForBit) {
  zinf::testing::TempDir dir;
  const float nan = std::bit_cast<float>(0x7fc00123u);  // a NaN with a payload
  std::vector<NamedTensor> tensors = {
      {"z.weight", {2, 3}, {1, -2, 3.5f, 0, -0.0f, nan}},
      {"empty", {0, 4}, {}},
      {"a.bias", {}, {std::numeric_limits<float>::infinity()}},
  };
  const std::string path = dir.file("t.safetensors");
  ASSERT_TRUE(write_safetensors(path, tensors).is_ok());
  auto back = parse_safetensors(read_file(path));
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ((*back)[i].name, tensors[i].name);
    EXPECT_EQ((*back)[i].shape, tensors[i].shape);
    ASSERT_EQ((*back)[i].data.size(), tensors[i].data.size());
    if (tensors[i].data.empty()) continue;  // (memcmp of no bytes may still not take nullptr)
    EXPECT_EQ(
        std::memcmp((*back)[i].data.data(), tensors[i].data.data(), tensors[i].data.size() * 4), 0)
        << tensors[i].name;
  }
}

TEST(Safetensors, TensorListsThatWouldMakeTheFileLieAreRefused) {
  zinf::testing::TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<std::pair<std::vector<NamedTensor>, std::string>> cases = {
      {{{"x", {1}, {1}}, {"x", {1}, {2}}}, "two tensors are named 'x'"},
      {{{"__metadata__", {1}, {1}}}, "reserved"},
      {{{"", {1}, {1}}}, "empty name"},
      {{{"caf\xe9", {1}, {1}}}, "not valid UTF-8"},
      {{{"w", {2}, {1, 2, 3}}}, "its shape holds 2 elements, its data 3"},
      {{{"w", {-1}, {}}}, "negative"},
  };
  for (const auto& [tensors, why] : cases) {
    Status s = write_safetensors(path, tensors);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
    EXPECT_FALSE(std::filesystem::exists(path)) << why;
    EXPECT_FALSE(std::filesystem::exists(path + ".partial")) << why;
  }
}

TEST(Safetensors, HeadersThatDoNotDescribeTheBytesAreRefused) {
  // The same two floats under headers that get the layout wrong in one way each.
  const std::vector<float> two = {1, 2};
  const auto f32 = [](const char* shape, const char* offsets) {
    return fmt::format(R"({{"w":{{"dtype":"F32","shape":{},"data_offsets":{}}}}})", shape, offsets);
  };
  ASSERT_TRUE(parse_safetensors(file_of(f32("[2]", "[0,8]"), two)).is_ok());
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases = {
      {file_of(f32("[3]", "[0,8]"), two), "3 elements in 8 bytes"},
      {file_of(f32("[1]", "[0,4]"), two), "end at byte 4 of a data section of 8"},
      {file_of(f32("[2]", "[0,12]"), two), "bytes [0, 12) of a data section of 8"},
      {file_of(f32("[1]", "[4,8]"), two), "starts at byte 4 of the data, expected 0"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
               two),
       "starts at byte 0 of the data, expected 8"},
      {file_of(f32("[-2]", "[0,8]"), two), "not a whole number"},
      {file_of(f32("[2]", "[0]"), two), "data_offsets is not [begin, end]"},
      {file_of(R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})", two), "only F32"},
      {file_of("[1,2]", two), "not a JSON object"},
      {file_of("{\"w\":", two), "not a JSON object"},
      {{1, 2, 3}, "no header length"},
  };
  for (const auto& [bytes, why] : cases) {
    auto r = parse_safetensors(bytes);
    ASSERT_FALSE(r.is_ok()) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  }
  // A header length past the end of the file.
  std::vector<uint8_t> lying = file_of(f32("[2]", "[0,8]"), two);
  lying[0] = 0xff;
  lying[7] = 0x7f;
  EXPECT_FALSE(parse_safetensors(lying).is_ok());
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// The mapped reader (zinf train --init-from) reads what the writer wrote bit for bit, and BF16 and
// F16 tensors widened exactly (against the scalar conversions of zinf/core/dtype.h), element by
// element, at offsets that need not be aligned.
TEST(SafetensorsFile, ReadsF32Bf16AndF16ElementByElement) {
  zinf::testing::TempDir dir;
  const float nan = std::bit_cast<float>(0x7fc00123u);
  std::vector<NamedTensor> tensors = {{"a", {2, 2}, {1, -2.5f, nan, 1e-30f}}, {"b", {0}, {}}};
  const std::string f32_path = dir.file("f32.safetensors");
  ASSERT_TRUE(write_safetensors(f32_path, tensors).is_ok());
  auto f = SafetensorsFile::open(f32_path);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  ASSERT_EQ(f->tensors().size(), 2u);
  const TensorInfo* a = f->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 2}));
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(f->value(*a, i)),
              std::bit_cast<uint32_t>(tensors[0].data[i]));
  }
  EXPECT_EQ(f->find("c"), nullptr);

  // Half-width tensors: a 3-byte odd header (no padding) puts the data at an odd offset.
  const std::vector<uint16_t> halves = {0x3f80, 0xc020, 0x7fc1, 0x0001, 0x3c00, 0x8001};
  std::vector<uint8_t> bytes(8);
  const std::string header = R"({"x":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                             R"("y":{"dtype":"F16","shape":[3],"data_offsets":[6,12]}} )";
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes.insert(bytes.end(), header.begin(), header.end());
  const auto* raw = reinterpret_cast<const uint8_t*>(halves.data());
  bytes.insert(bytes.end(), raw, raw + halves.size() * 2);
  const std::string half_path = dir.file("half.safetensors");
  write_bytes(half_path, bytes);
  auto h = SafetensorsFile::open(half_path);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  const TensorInfo* x = h->find("x");
  const TensorInfo* y = h->find("y");
  ASSERT_TRUE(x && y);
  EXPECT_EQ(x->dtype, DType::kBF16);
  EXPECT_EQ(y->dtype, DType::kF16);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(h->value(*x, i)),
              std::bit_cast<uint32_t>(bf16_to_f32(halves[i])));
    EXPECT_EQ(std::bit_cast<uint32_t>(h->value(*y, i)),
              std::bit_cast<uint32_t>(f16_to_f32(halves[3 + i])));
  }
  // Moved, the mapping goes with it.
  SafetensorsFile moved = std::move(*h);
  EXPECT_EQ(moved.value(*x, 0), 1.0f);
}

// The mapped reader refuses what parse_safetensors refuses, names the file, and refuses a dtype
// it cannot widen to fp32 naming the tensor.
TEST(SafetensorsFile, RefusesBadFilesNamingThem) {
  zinf::testing::TempDir dir;
  const std::vector<float> two = {1, 2};
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases = {
      {file_of(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", two),
       "tensor 'w': dtype F64 (not convertible to fp32"},
      {file_of(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", two),
       "3 elements in 8 bytes"},
      {file_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", two),
       "end at byte 4 of a data section of 8"},
      {{1, 2, 3}, "no header length"},
  };
  int i = 0;
  for (const auto& [bytes, why] : cases) {
    const std::string path = dir.file(fmt::format("bad{}.safetensors", i++));
    write_bytes(path, bytes);
    auto r = SafetensorsFile::open(path);
    ASSERT_FALSE(r.is_ok()) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  }
  auto missing = SafetensorsFile::open(dir.file("missing.safetensors"));
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
}

}  // namespace
}  // namespace zinf::gpt
