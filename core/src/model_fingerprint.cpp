#include "kvrelay/core/model_fingerprint.h"

#include <xxhash.h>

#include "le_writer.h"

namespace kvrelay {

std::uint64_t ModelFingerprint::id() const noexcept {
  detail::LeWriter writer;
  writer.put(std::uint32_t{1});  // encoding version of this fingerprint
  writer.put_string(architecture);
  writer.put(layers);
  writer.put(kv_heads);
  writer.put(head_dim);
  writer.put(static_cast<std::uint8_t>(dtype));
  writer.put_string(weights_identity);
  return XXH3_64bits(writer.bytes().data(), writer.bytes().size());
}

}  // namespace kvrelay
