// Byte sizes as users write them: "4096", "128K", "1M", "4G", "1.5GiB". Binary multiples
// (K = 1024). Formatting back to a short human string for tables and progress lines.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf {

Result<uint64_t> parse_bytes(std::string_view text);
std::string format_bytes(double bytes);       // "1.50 GiB"
std::string format_rate(double bytes_per_s);  // "1.23 GB/s" (decimal, as fio prints)
std::string format_count(double n);           // "834.3 K", "2.05 B" (parameters)

constexpr uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}
constexpr uint64_t align_down(uint64_t value, uint64_t alignment) {
  return value / alignment * alignment;
}

}  // namespace zinf
