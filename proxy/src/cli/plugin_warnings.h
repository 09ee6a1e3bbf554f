#pragma once

// What a CLI command says about codec plugins it could not load: one warning line each on
// stderr, and the command goes on with the codecs it has (as the daemon does).

#include <span>

#include "kvrelay/codec_plugins/registry.h"

namespace kvrelay::cli {

void warn_refused_plugins(std::span<const codec::PluginLoadFailure> failures);

}  // namespace kvrelay::cli
