#include "zinf/core/units.h"

#include <cctype>
#include <charconv>
#include <cmath>

namespace zinf {

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  if (s.empty()) return make_error(ErrorCode::kInvalidArgument, "empty size");
  size_t digits = 0;
  while (digits < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.'))
    ++digits;
  if (digits == 0) {
    return make_error(ErrorCode::kInvalidArgument, "size '{}' does not start with a number", text);
  }
  double number = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + digits, number);
  if (ec != std::errc() || ptr != s.data() + digits) {
    return make_error(ErrorCode::kInvalidArgument, "size '{}' is not a number", text);
  }
  std::string suffix;
  for (char c : s.substr(digits)) {
    if (!std::isspace(static_cast<unsigned char>(c))) suffix += static_cast<char>(std::toupper(c));
  }
  if (suffix.ends_with("IB"))
    suffix.resize(suffix.size() - 2);
  else if (suffix.size() > 1 && suffix.ends_with("B"))
    suffix.resize(suffix.size() - 1);
  double scale = 1;
  if (suffix.empty() || suffix == "B")
    scale = 1;
  else if (suffix == "K")
    scale = 1024.0;
  else if (suffix == "M")
    scale = 1024.0 * 1024;
  else if (suffix == "G")
    scale = 1024.0 * 1024 * 1024;
  else if (suffix == "T")
    scale = 1024.0 * 1024 * 1024 * 1024;
  else {
    return make_error(ErrorCode::kInvalidArgument,
                      "size '{}' has an unknown suffix (use K, M, G or T)", text);
  }
  double bytes = number * scale;
  if (bytes != std::floor(bytes)) {
    return make_error(ErrorCode::kInvalidArgument, "size '{}' is not a whole number of bytes",
                      text);
  }
  if (bytes > 1.8e19)
    return make_error(ErrorCode::kInvalidArgument, "size '{}' is too large", text);
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string format_rate(double bytes_per_s) {
  const char* units[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  int u = 0;
  while (bytes_per_s >= 1000 && u < 4) {
    bytes_per_s /= 1000;
    ++u;
  }
  return fmt::format("{:.2f} {}", bytes_per_s, units[u]);
}

std::string format_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f} M", n / 1e6);
  return fmt::format("{:.1f} K", n / 1e3);
}

}  // namespace zinf
