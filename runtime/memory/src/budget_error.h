// The error every device backend returns when an allocation would pass its budget.
#pragma once

#include <cstdint>

#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/memory/accounting.h"

namespace zinf {

inline Status device_budget_exhausted(uint64_t requested, MemoryCategory category, uint64_t in_use,
                                      uint64_t budget) {
  return make_error(ErrorCode::kOutOfMemory,
                    "device budget exhausted: {} requested for {} while {} of the {} budget is "
                    "in use",
                    format_bytes(static_cast<double>(requested)), category_name(category),
                    format_bytes(static_cast<double>(in_use)),
                    format_bytes(static_cast<double>(budget)));
}

}  // namespace zinf
