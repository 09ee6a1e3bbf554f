#pragma once

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

// Installs the process-wide spdlog logger described by the policy (level, text/json, file).
[[nodiscard]] Status configure_logging(const LoggingPolicy& logging);

}  // namespace kvrelay::proxy
