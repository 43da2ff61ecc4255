#include "zinf/core/tunables.h"

#include <fmt/format.h>

namespace zinf::tunables {

std::string to_string(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string_view>) {
          return x.empty() ? "\"\"" : std::string(x);
        } else {
          return fmt::format("{}", x);  // the shortest text that reads back to the same value
        }
      },
      v);
}

}  // namespace zinf::tunables
