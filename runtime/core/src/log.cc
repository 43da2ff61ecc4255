#include "zinf/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <set>

namespace zinf::log {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("zinf");
    l->set_pattern("[zinf %^%l%$] %v");
    const char* level = std::getenv("ZINF_LOG_LEVEL");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
    return l;
  }();
  return *instance;
}

bool warn_once(std::string_view key, std::string_view message) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard lock(mu);
    if (!seen.emplace(key).second) return false;
  }
  logger().warn("{}", message);
  return true;
}

}  // namespace zinf::log
