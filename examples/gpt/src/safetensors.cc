#include "zinf/gpt/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

namespace zinf::gpt {

namespace {

// Why `tensors` cannot be written as they are, or "" when they can. Each of these would otherwise
// make a file that does not say what it holds: a repeated name or "__metadata__" overwrites an
// entry of the header while the data stays, a name that is not UTF-8 makes the JSON writer throw,
// a shape that disagrees with the data describes other bytes than those written.
std::string refusal(const std::vector<NamedTensor>& tensors) {
  std::set<std::string_view> names;
  for (const NamedTensor& t : tensors) {
    if (t.name.empty()) return "a tensor has an empty name";
    if (t.name == "__metadata__") return "a tensor is named __metadata__ (reserved)";
    if (!names.insert(t.name).second) return fmt::format("two tensors are named '{}'", t.name);
    try {
      (void)nlohmann::json(t.name).dump();
    } catch (const nlohmann::json::type_error&) {
      return fmt::format("the name of tensor {} is not valid UTF-8", names.size() - 1);
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
        return fmt::format("tensor '{}' has a negative or overflowing shape", t.name);
      }
    }
    if (numel != t.data.size()) {
      return fmt::format("tensor '{}': its shape holds {} elements, its data {}", t.name, numel,
                         t.data.size());
    }
  }
  return "";
}

}  // namespace

Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors) {
  if (std::string why = refusal(tensors); !why.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "cannot write {}: {}", path, why);
  }
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const NamedTensor& t : tensors) {
    uint64_t bytes = t.data.size() * 4;
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"producer", "zinf"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  // Written under `<path>.partial` and renamed: a reader never sees half a file. The partial
  // file is created fresh (O_EXCL: never through a symlink planted under its name, which is
  // removed as a stale partial would be), written whole, synced, then renamed over `path`.
  const std::string tmp = path + ".partial";
  struct stat st {};
  if (::lstat(tmp.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) (void)::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status(errno, fmt::format("cannot create {}", tmp));
  auto write_all = [fd](const void* data, uint64_t bytes) -> int {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return n < 0 ? errno : EIO;
      p += n;
      bytes -= static_cast<uint64_t>(n);
    }
    return 0;
  };
  const uint64_t n = text.size();
  int err = write_all(&n, 8);
  if (err == 0) err = write_all(text.data(), text.size());
  for (const NamedTensor& t : tensors) {
    if (err == 0) err = write_all(t.data.data(), t.data.size() * 4);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    (void)::unlink(tmp.c_str());
    return errno_status(err, fmt::format("error writing {}", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    (void)::unlink(tmp.c_str());
    return errno_status(err, fmt::format("cannot move {} to {}", tmp, path));
  }
  return Status::ok();
}

namespace {

// What the reader accepts of a header (the format's own limit is 100 MB; zinf's are far smaller).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

Status corrupt(std::string why) { return make_error(ErrorCode::kCorrupt, "safetensors: {}", why); }

}  // namespace

Result<std::vector<NamedTensor>> parse_safetensors(std::span<const uint8_t> bytes) {
  if (bytes.size() < 8) return corrupt(fmt::format("{} bytes: no header length", bytes.size()));
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{bytes[i]} << (8 * i);
  if (header_bytes > bytes.size() - 8 || header_bytes > kMaxHeaderBytes) {
    return corrupt(fmt::format("a header of {} bytes in a file of {}", header_bytes, bytes.size()));
  }
  const auto* text = reinterpret_cast<const char*>(bytes.data() + 8);
  nlohmann::json header = nlohmann::json::parse(text, text + header_bytes, nullptr,
                                                /*allow_exceptions=*/false);
  if (!header.is_object()) return corrupt("the header is not a JSON object");
  const std::span<const uint8_t> data = bytes.subspan(8 + header_bytes);

  struct Entry {
    uint64_t begin, end;
    NamedTensor tensor;
  };
  std::vector<Entry> entries;
  for (const auto& item : header.items()) {
    const std::string& name = item.key();  // (named here: clang 14 cannot capture a binding)
    const nlohmann::json& info = item.value();
    if (name == "__metadata__") {
      if (!info.is_object()) return corrupt("__metadata__ is not an object");
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) return corrupt(fmt::format("__metadata__.{} is not a string", key));
      }
      continue;
    }
    auto bad = [&](std::string_view why) {
      return corrupt(fmt::format("tensor '{}': {}", name, why));
    };
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") ||
        !info.contains("data_offsets")) {
      return bad("expected an object with dtype, shape and data_offsets");
    }
    const auto& dtype = info["dtype"];
    if (!dtype.is_string()) return bad("dtype is not a string");
    if (dtype.get<std::string>() != "F32") {
      return make_error(ErrorCode::kInvalidArgument,
                        "safetensors: tensor '{}': dtype {} (only F32 is read)", name,
                        dtype.get<std::string>());
    }
    const auto& shape = info["shape"];
    if (!shape.is_array()) return bad("shape is not an array");
    NamedTensor t{.name = name};
    uint64_t numel = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) return bad("a dimension is not a whole number >= 0");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, dim, &numel)) {
        return bad("the shape's element count overflows");
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return bad("data_offsets is not [begin, end]");
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (begin > end || end > data.size()) {
      return bad(fmt::format("bytes [{}, {}) of a data section of {}", begin, end, data.size()));
    }
    if (numel > (end - begin) / 4 || numel * 4 != end - begin) {
      return bad(fmt::format("{} elements in {} bytes", numel, end - begin));
    }
    entries.push_back({begin, end, std::move(t)});
  }
  // The ranges tile the data section: in order, without overlap or hole, to its end.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  uint64_t next = 0;
  for (const Entry& e : entries) {
    if (e.begin != next) {
      return corrupt(fmt::format("tensor '{}' starts at byte {} of the data, expected {}",
                                 e.tensor.name, e.begin, next));
    }
    next = e.end;
  }
  if (next != data.size()) {
    return corrupt(
        fmt::format("the tensors end at byte {} of a data section of {}", next, data.size()));
  }
  std::vector<NamedTensor> out;
  out.reserve(entries.size());
  for (Entry& e : entries) {
    e.tensor.data.resize((e.end - e.begin) / 4);
    if (!e.tensor.data.empty())
      std::memcpy(e.tensor.data.data(), data.data() + e.begin, e.end - e.begin);
    out.push_back(std::move(e.tensor));
  }
  return out;
}

}  // namespace zinf::gpt
