// The config reader (zinf::config::parse_config_text) on arbitrary text. Properties: it returns
// a Config or an error, never crashes, throws or runs away with memory; and a Config it accepts
// survives the trip through its own DeepSpeed-format JSON: parse_config(to_json(c)) == c, parse
// notes aside (config.h).
#include "zinf/config/config.h"

#include <nlohmann/json.hpp>
#include <string_view>

#include "fuzz_check.h"
#include "zinf/core/log.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  zinf::log::logger().set_level(spdlog::level::off);  // unknown keys are warned about: quiet
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zinf::config;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  zinf::Result<Config> c = parse_config_text(text);
  if (!c.is_ok()) {
    FUZZ_CHECK(!c.status().message().empty());
    return 0;
  }
  Config original = *c;
  original.unknown_keys.clear();
  original.auto_keys.clear();
  original.ignored_keys.clear();
  original.given_keys.clear();
  zinf::Result<Config> again = parse_config(to_json(original));
  FUZZ_CHECK(again.is_ok());
  again->unknown_keys.clear();
  again->auto_keys.clear();
  again->ignored_keys.clear();
  again->given_keys.clear();
  FUZZ_CHECK(*again == original);
  return 0;
}
