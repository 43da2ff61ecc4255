// The safetensors writer and reader together: tensors made from the input (names of arbitrary
// bytes, shapes of up to 3 small dimensions, an element count that may or may not match the
// shape, raw float bits) go through zinf::gpt::write_safetensors into a file, which
// parse_safetensors reads back. Properties: the writer refuses exactly the tensor lists its
// contract refuses (safetensors.h) with kInvalidArgument and leaves no file; whatever it writes
// reads back bit for bit, names, shapes and order included.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <span>
#include <string>

#include "fuzz_check.h"
#include "zinf/gpt/safetensors.h"

namespace {

// A cursor over the input; past its end every byte reads as 0.
struct Bytes {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  std::string take(size_t k) {
    k = std::min(k, n);
    std::string s(reinterpret_cast<const char*>(p), k);
    p += k;
    n -= k;
    return s;
  }
};

// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF): an oracle written apart
// from the writer's own check.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

std::string g_dir;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // tmpfs when there is one: the writer fsyncs every file.
  std::string base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
  std::string tmpl = base + "/zinf-fuzz-safetensors-XXXXXX";
  FUZZ_CHECK(::mkdtemp(tmpl.data()) != nullptr);
  g_dir = tmpl;
  std::atexit([] { std::filesystem::remove_all(g_dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using zinf::gpt::NamedTensor;
  Bytes in{data, size};
  std::vector<NamedTensor> tensors;
  bool expect_ok = true;
  std::set<std::string> names;
  const size_t count = in.u8() % 5;
  for (size_t i = 0; i < count; ++i) {
    NamedTensor t;
    t.name = in.take(in.u8() % 16);
    const size_t rank = in.u8() % 4;
    size_t numel = 1;
    for (size_t d = 0; d < rank; ++d) {
      t.shape.push_back(in.u8() % 8);
      numel *= static_cast<size_t>(t.shape.back());
    }
    // Usually the shape's count; one time in eight, any count up to 15.
    const uint8_t how = in.u8();
    const size_t elements = (how & 7) == 0 ? (how >> 3) % 16 : numel;
    t.data.resize(elements);
    for (float& x : t.data) {
      const std::string raw = in.take(4) + std::string(4, '\0');
      std::memcpy(&x, raw.data(), 4);
    }
    expect_ok = expect_ok && !t.name.empty() && t.name != "__metadata__" && valid_utf8(t.name) &&
                names.insert(t.name).second && elements == numel;
    tensors.push_back(std::move(t));
  }

  const std::string path = g_dir + "/t.safetensors";
  std::filesystem::remove(path);
  zinf::Status written = zinf::gpt::write_safetensors(path, tensors);
  FUZZ_CHECK(written.is_ok() == expect_ok);
  FUZZ_CHECK(!std::filesystem::exists(path + ".partial"));
  if (!written.is_ok()) {
    FUZZ_CHECK(written.code() == zinf::ErrorCode::kInvalidArgument);
    FUZZ_CHECK(!std::filesystem::exists(path));
    return 0;
  }
  std::ifstream file(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)),
                             std::istreambuf_iterator<char>());
  auto back = zinf::gpt::parse_safetensors(bytes);
  FUZZ_CHECK(back.is_ok());
  FUZZ_CHECK(back->size() == tensors.size());
  // The reader orders by data offset, the writer lays tensors out in the order given; a tensor
  // with no elements has no bytes, so among empty tensors at one offset the order is the names'.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor* want = &tensors[i];
    const NamedTensor* got = nullptr;
    for (const NamedTensor& t : *back) {
      if (t.name == want->name) got = &t;
    }
    FUZZ_CHECK(got != nullptr);
    FUZZ_CHECK(got->shape == want->shape);
    FUZZ_CHECK(got->data.size() == want->data.size());
    FUZZ_CHECK(want->data.empty() ||
               std::memcmp(got->data.data(), want->data.data(), want->data.size() * 4) == 0);
    if (!want->data.empty()) FUZZ_CHECK(&(*back)[i] == got);
  }
  return 0;
}
