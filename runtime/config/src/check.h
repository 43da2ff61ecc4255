// The value rules of the configuration (internal to zinf_config): ranges and combinations that do
// not need the world size. parse_config and validate both apply them, so a Config built in code
// is held to the same rules as one read from JSON. Errors name the JSON path of the key.
#pragma once

#include "zinf/config/config.h"

namespace zinf::config::detail {

Status check_config(const Config& c);

}  // namespace zinf::config::detail
