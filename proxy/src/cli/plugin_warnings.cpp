#include "plugin_warnings.h"

#include <cstdio>

namespace kvrelay::cli {

void warn_refused_plugins(std::span<const codec::PluginLoadFailure> failures) {
  for (const auto& failure : failures) {
    std::fprintf(stderr, "warning: plugin %s refused: %s\n", failure.path.c_str(), failure.error.to_string().c_str());
  }
}

}  // namespace kvrelay::cli
