#include "kvrelay/broker/engine_codecs.h"

#include <string>

namespace kvrelay::broker {

std::vector<decision::PluginCodec> engine_codecs(const codec::CodecRegistry& codecs) {
  std::vector<decision::PluginCodec> loaded;
  loaded.reserve(codecs.codecs().size());
  for (const auto& codec : codecs.codecs())
    loaded.push_back({std::string(codec->name()), codec->lossless()});
  return loaded;
}

}  // namespace kvrelay::broker
