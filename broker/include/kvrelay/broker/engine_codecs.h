#pragma once

// The codecs a decision engine may price as media: every codec of the registry this process
// loaded (built-ins and plugins). The daemon's KV path and `kvrelay decision explain` build
// their engines from the same list, so the explanation prices what the daemon would.

#include <vector>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/decision/engine_from_policy.h"

namespace kvrelay::broker {

[[nodiscard]] std::vector<decision::PluginCodec> engine_codecs(const codec::CodecRegistry& codecs);

}  // namespace kvrelay::broker
