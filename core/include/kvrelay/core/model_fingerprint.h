#pragma once

#include <cstdint>
#include <string>

#include "kvrelay/core/dtype.h"
#include "kvrelay/core/kv_layout.h"

namespace kvrelay {

// What decides whether KV computed by one worker is usable by another: the same architecture,
// shape, dtype and weights. KV moves only between identical fingerprints.
struct ModelFingerprint {
  std::string architecture;  // "llama"
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  DType dtype = DType::kFloat32;
  std::string weights_identity;  // checkpoint digest or release name

  // Stable across processes, hosts and releases: xxh3_64 of a canonical little-endian
  // encoding of every field (see docs/wire-format.md). Used in block hashes and on the wire.
  [[nodiscard]] std::uint64_t id() const noexcept;

  [[nodiscard]] KvLayout layout(std::uint64_t tokens) const {
    return KvLayout{layers, kv_heads, head_dim, dtype, tokens};
  }

  [[nodiscard]] bool kv_compatible_with(const ModelFingerprint& other) const noexcept { return id() == other.id(); }

  friend bool operator==(const ModelFingerprint&, const ModelFingerprint&) = default;
};

}  // namespace kvrelay
