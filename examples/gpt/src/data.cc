#include "zinf/gpt/data.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include "random.h"

namespace zinf::gpt {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxTextBytes = uint64_t{4} << 30;  // the text is held in memory whole

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

Result<std::string> read_file(const std::string& path) {
  // Only a regular file of bounded size: the text is read into memory whole, and opening a FIFO
  // would wait for a writer forever (/dev/zero would never end). Checked before opening.
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec) return errno_status(ec.value(), fmt::format("cannot open text file {}", path));
  if (fs::is_directory(st)) {
    return make_error(ErrorCode::kInvalidArgument, "text file {} is a directory", path);
  }
  if (!fs::is_regular_file(st)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "text file {} is not a regular file (a device, FIFO or socket): give a file "
                      "of text",
                      path);
  }
  const uint64_t bytes = fs::file_size(path, ec);
  if (!ec && bytes > kMaxTextBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "text file {} has {} bytes; the trainer reads its text into memory and takes "
                      "at most {}",
                      path, bytes, kMaxTextBytes);
  }
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return errno_status(errno, fmt::format("cannot open text file {}", path));
  std::string text;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f.get())) > 0) text.append(buf, got);
  if (std::ferror(f.get())) return errno_status(errno, fmt::format("cannot read {}", path));
  return text;
}

// A fortune file with its "%" separator lines made empty: fortunes end up separated by a blank
// line.
std::string strip_separators(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    if (line != "%" && line != "%\r") out.append(line);
    out.push_back('\n');
    pos = end + 1;
  }
  return out;
}

}  // namespace

Result<TextDataset> TextDataset::from_text(std::string text, std::string source) {
  if (text.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "text {} is empty: nothing to train on", source);
  }
  return TextDataset(std::move(text), std::move(source));
}

Result<TextDataset> TextDataset::from_file(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::string text, read_file(path));
  return from_text(std::move(text), path);
}

Result<TextDataset> TextDataset::from_fortunes(std::string_view dir_view) {
  const fs::path dir(dir_view);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return make_error(ErrorCode::kNotFound,
                      "no fortunes directory {} (install Debian's `fortunes` package, or give a "
                      "text file)",
                      dir.string());
  }
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    // The fortune files themselves: no extension (.dat is strfile's index, .u8 a UTF-8 copy);
    // subdirectories (off/: the offensive ones) are left out.
    std::error_code type_ec;
    if (name.find('.') == std::string::npos && e.is_regular_file(type_ec)) {
      files.push_back(e.path());
    }
  }
  if (ec) return errno_status(ec.value(), fmt::format("cannot list {}", dir.string()));
  if (files.empty()) {
    return make_error(ErrorCode::kNotFound, "no fortune files in {}", dir.string());
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const fs::path& p : files) {
    ZINF_ASSIGN_OR_RETURN(std::string body, read_file(p.string()));
    text += strip_separators(body);
  }
  return from_text(std::move(text),
                   fmt::format("{} ({} fortune files)", dir.string(), files.size()));
}

Result<TextDataset> TextDataset::load(std::string_view path) {
  if (path.empty()) return from_fortunes();
  return from_file(std::string(path));
}

Status TextDataset::check_window(int seq) const {
  if (seq <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "sequence length {} must be positive", seq);
  }
  if (size() < int64_t{seq} + 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "text {} has {} bytes, fewer than sequence length + 1 = {}", source_, size(),
                      int64_t{seq} + 1);
  }
  return Status::ok();
}

Status TextDataset::sample_batch(uint64_t seed, uint64_t step, int rank, int batch, int seq,
                                 int32_t* tokens, int32_t* targets) const {
  if (batch <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "batch size {} must be positive", batch);
  }
  ZINF_RETURN_IF_ERROR(check_window(seq));
  // Window starts 0 .. size - seq - 1: the last target is byte size - 1.
  const auto starts = static_cast<uint64_t>(size() - seq);
  const auto* bytes = reinterpret_cast<const unsigned char*>(text_.data());
  for (int b = 0; b < batch; ++b) {
    const uint64_t h = detail::hash_words(
        {seed, step, static_cast<uint64_t>(rank), static_cast<uint64_t>(b), 0x64617461ull});
    const uint64_t start = h % starts;
    for (int t = 0; t < seq; ++t) {
      tokens[int64_t{b} * seq + t] = bytes[start + t];
      targets[int64_t{b} * seq + t] = bytes[start + t + 1];
    }
  }
  return Status::ok();
}

Result<std::pair<TextDataset, TextDataset>> TextDataset::split(double validation_fraction) const {
  if (!(validation_fraction > 0.0 && validation_fraction < 1.0)) {
    return make_error(ErrorCode::kInvalidArgument, "validation fraction {} is not in (0, 1)",
                      validation_fraction);
  }
  const auto held_out =
      static_cast<size_t>(static_cast<double>(text_.size()) * validation_fraction);
  if (held_out == 0 || held_out == text_.size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "text {} of {} bytes is too short to hold out a fraction {}", source_, size(),
                      validation_fraction);
  }
  const size_t train = text_.size() - held_out;
  return std::pair{TextDataset(text_.substr(0, train), source_ + " [train]"),
                   TextDataset(text_.substr(train), source_ + " [validation]")};
}

}  // namespace zinf::gpt
