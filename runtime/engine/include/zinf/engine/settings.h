// From a DeepSpeed-format configuration (zinf/config/config.h) to the Engine's settings.
#pragma once

#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace zinf {

// Maps every key the engine acts on; keys accepted but not acted upon (e.g. offload ratio < 1)
// are named in one warning.
Result<EngineSettings> settings_from_config(const config::Config& c);

}  // namespace zinf
