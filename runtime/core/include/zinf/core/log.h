// Logging: spdlog under a "zinf" logger. ZINF_LOG_LEVEL=trace|debug|info|warn|error|off sets the
// level (default info). warn_once() says a thing once per process, however often it happens.
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <string_view>

namespace zinf::log {

spdlog::logger& logger();

template <typename... Args>
void info(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().info(f, std::forward<Args>(args)...);
}
template <typename... Args>
void warn(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().warn(f, std::forward<Args>(args)...);
}
template <typename... Args>
void debug(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().debug(f, std::forward<Args>(args)...);
}
template <typename... Args>
void error(spdlog::format_string_t<Args...> f, Args&&... args) {
  logger().error(f, std::forward<Args>(args)...);
}

// Logs `message` as a warning the first time `key` is seen in this process; returns whether it
// logged. Thread-safe.
bool warn_once(std::string_view key, std::string_view message);

}  // namespace zinf::log
