#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvrelay/core/result.h"

namespace kvrelay::refworker {

// Shape of a Llama-architecture model, as in llama2.c's checkpoint header.
struct ModelConfig {
  std::uint32_t dim = 0;
  std::uint32_t hidden_dim = 0;
  std::uint32_t layers = 0;
  std::uint32_t heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t vocab_size = 0;
  std::uint32_t seq_len = 0;
  // llama2.c: a positive vocab_size in the header means the classifier is the embedding table.
  bool shared_classifier = true;

  // Bounds that reject absurd headers before any size is computed from them.
  static constexpr std::uint32_t kMaxDim = 65536;
  static constexpr std::uint32_t kMaxHiddenDim = 262144;
  static constexpr std::uint32_t kMaxLayers = 1024;
  static constexpr std::uint32_t kMaxHeads = 1024;
  static constexpr std::uint32_t kMaxVocab = 1U << 20;
  static constexpr std::uint32_t kMaxSeqLen = 1U << 20;

  [[nodiscard]] std::uint32_t head_dim() const { return heads == 0 ? 0 : dim / heads; }
  [[nodiscard]] std::uint32_t kv_dim() const { return heads == 0 ? 0 : kv_heads * head_dim(); }

  // Every field within bounds, heads divide dim, kv_heads divide heads, head_dim even (RoPE pairs).
  [[nodiscard]] Status validate() const;

  // "layers=5,dim=64,heads=8,kv_heads=4,ffn=172,vocab=512,seq_len=512"
  [[nodiscard]] std::string shape_string() const;

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Parses "layers=16,dim=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000[,seq_len=N]". Missing keys
// take the defaults of a small model; unknown keys and malformed numbers are errors.
[[nodiscard]] Result<ModelConfig> parse_shape(std::string_view text);

}  // namespace kvrelay::refworker
