// Saving and loading one rank's part of the engine's state (Engine::save_checkpoint,
// Engine::load_checkpoint): the tensors through the store, tensor by tensor; the scalars the
// engine's parts keep (optimizer step, loss scaler, skip counters) travel as a JSON object that
// engine.cc fills and applies.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "engine_state.h"
#include "zinf/ckpt/manifest.h"

namespace zinf::engine_detail {

Result<std::string> save_checkpoint(EngineState& e, const nlohmann::json& scalars,
                                    const std::string& root, const SaveCheckpointOptions& options);

struct LoadedState {
  LoadedCheckpoint info;
  nlohmann::json scalars;  // what save_checkpoint() was given
};
// On failure nothing of the engine's state has been overwritten unless the failure came while
// reading files that had verified (the error then says the engine must not be used).
Result<LoadedState> load_checkpoint(EngineState& e, const std::string& path);

}  // namespace zinf::engine_detail
