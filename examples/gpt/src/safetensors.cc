#include "zinf/gpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

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

// The header's tensors, checked against a data section of `data_bytes`, in the order of their
// data. `f32_only`: parse_safetensors (which returns fp32 vectors) reads F32 alone; the mapped
// reader also BF16 and F16.
Result<std::vector<TensorInfo>> parse_header(std::string_view text, uint64_t data_bytes,
                                             bool f32_only) {
  nlohmann::json header = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                                /*allow_exceptions=*/false);
  if (!header.is_object()) return corrupt("the header is not a JSON object");
  std::vector<TensorInfo> entries;
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
    const std::string dtype_text = dtype.get<std::string>();
    TensorInfo t{.name = name};
    if (dtype_text == "F32") {
      t.dtype = DType::kF32;
    } else if (!f32_only && dtype_text == "BF16") {
      t.dtype = DType::kBF16;
    } else if (!f32_only && dtype_text == "F16") {
      t.dtype = DType::kF16;
    } else {
      return make_error(
          ErrorCode::kInvalidArgument, "safetensors: tensor '{}': dtype {} ({})", name, dtype_text,
          f32_only ? "only F32 is read" : "not convertible to fp32: zinf reads F32, BF16 and F16");
    }
    const auto& shape = info["shape"];
    if (!shape.is_array()) return bad("shape is not an array");
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
    if (begin > end || end > data_bytes) {
      return bad(fmt::format("bytes [{}, {}) of a data section of {}", begin, end, data_bytes));
    }
    const uint64_t esize = dtype_size(t.dtype);
    if (numel > (end - begin) / esize || numel * esize != end - begin) {
      return bad(fmt::format("{} elements in {} bytes", numel, end - begin));
    }
    t.numel = numel;
    t.data_begin = begin;
    t.data_end = end;
    entries.push_back(std::move(t));
  }
  // The ranges tile the data section: in order, without overlap or hole, to its end.
  std::sort(entries.begin(), entries.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin < b.data_begin || (a.data_begin == b.data_begin && a.data_end < b.data_end);
  });
  uint64_t next = 0;
  for (const TensorInfo& e : entries) {
    if (e.data_begin != next) {
      return corrupt(fmt::format("tensor '{}' starts at byte {} of the data, expected {}", e.name,
                                 e.data_begin, next));
    }
    next = e.data_end;
  }
  if (next != data_bytes) {
    return corrupt(
        fmt::format("the tensors end at byte {} of a data section of {}", next, data_bytes));
  }
  return entries;
}

// The header's length from the first 8 bytes of a file of `file_bytes`, checked to fit.
Result<uint64_t> header_length(const uint8_t* first8, uint64_t file_bytes) {
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{first8[i]} << (8 * i);
  if (header_bytes > file_bytes - 8 || header_bytes > kMaxHeaderBytes) {
    return corrupt(fmt::format("a header of {} bytes in a file of {}", header_bytes, file_bytes));
  }
  return header_bytes;
}

}  // namespace

Result<std::vector<NamedTensor>> parse_safetensors(std::span<const uint8_t> bytes) {
  if (bytes.size() < 8) return corrupt(fmt::format("{} bytes: no header length", bytes.size()));
  ZINF_ASSIGN_OR_RETURN(const uint64_t header_bytes, header_length(bytes.data(), bytes.size()));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), header_bytes);
  const std::span<const uint8_t> data = bytes.subspan(8 + header_bytes);
  ZINF_ASSIGN_OR_RETURN(std::vector<TensorInfo> entries,
                        parse_header(text, data.size(), /*f32_only=*/true));
  std::vector<NamedTensor> out;
  out.reserve(entries.size());
  for (TensorInfo& e : entries) {
    NamedTensor t{.name = std::move(e.name), .shape = std::move(e.shape)};
    t.data.resize(e.numel);
    if (!t.data.empty()) std::memcpy(t.data.data(), data.data() + e.data_begin, e.numel * 4);
    out.push_back(std::move(t));
  }
  return out;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  auto with_path = [&](Status s) { return std::move(s).with_context(path); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, fmt::format("cannot open {}", path));
  SafetensorsFile f;
  f.path_ = path;
  struct stat st {};
  Status status;
  if (::fstat(fd, &st) != 0) {
    status = errno_status(errno, fmt::format("cannot stat {}", path));
  } else if (!S_ISREG(st.st_mode)) {
    status = make_error(ErrorCode::kInvalidArgument, "{} is not a regular file", path);
  } else if (st.st_size < 8) {
    status = with_path(corrupt(fmt::format("{} bytes: no header length", st.st_size)));
  } else {
    f.map_bytes_ = static_cast<uint64_t>(st.st_size);
    void* map = ::mmap(nullptr, f.map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      status = errno_status(errno, fmt::format("cannot map {}", path));
    } else {
      f.map_ = map;
    }
  }
  ::close(fd);  // the mapping keeps the file
  ZINF_RETURN_IF_ERROR(status);
  const auto* bytes = static_cast<const uint8_t*>(f.map_);
  auto header_bytes = header_length(bytes, f.map_bytes_);
  if (!header_bytes.is_ok()) return with_path(header_bytes.status());
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), *header_bytes);
  auto tensors = parse_header(text, f.map_bytes_ - 8 - *header_bytes, /*f32_only=*/false);
  if (!tensors.is_ok()) return with_path(tensors.status());
  f.tensors_ = std::move(*tensors);
  f.data_ = bytes + 8 + *header_bytes;
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    tensors_ = std::move(other.tensors_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  data_ = nullptr;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

float SafetensorsFile::value(const TensorInfo& t, uint64_t i) const {
  ZINF_CHECK(i < t.numel);
  const uint8_t* p = data_ + t.data_begin + i * dtype_size(t.dtype);
  if (t.dtype == DType::kF32) {
    float v;
    std::memcpy(&v, p, 4);  // (the data need not be 4-byte aligned)
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t.dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

}  // namespace zinf::gpt
