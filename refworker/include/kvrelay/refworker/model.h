#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/core/result.h"
#include "kvrelay/refworker/model_config.h"

namespace kvrelay::refworker {

// Views into Model's weight storage for one transformer layer. Matrices are row-major
// [out_features, in_features], as llama2.c stores them.
struct LayerWeights {
  const float* rms_att = nullptr;  // [dim]
  const float* wq = nullptr;       // [dim, dim]
  const float* wk = nullptr;       // [kv_dim, dim]
  const float* wv = nullptr;       // [kv_dim, dim]
  const float* wo = nullptr;       // [dim, dim]
  const float* rms_ffn = nullptr;  // [dim]
  const float* w1 = nullptr;       // [hidden, dim]
  const float* w2 = nullptr;       // [dim, hidden]
  const float* w3 = nullptr;       // [hidden, dim]
};

// A loaded (or synthesized) fp32 Llama model. Immutable after construction; sessions share it.
class Model {
 public:
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  ~Model() = default;

  [[nodiscard]] const ModelConfig& config() const { return config_; }
  [[nodiscard]] const ModelFingerprint& fingerprint() const { return fingerprint_; }
  [[nodiscard]] const float* token_embedding() const { return storage_.data() + embedding_offset_; }
  [[nodiscard]] const LayerWeights& layer(std::size_t index) const { return layers_[index]; }
  [[nodiscard]] const float* rms_final() const { return storage_.data() + rms_final_offset_; }
  [[nodiscard]] const float* classifier() const { return storage_.data() + classifier_offset_; }
  [[nodiscard]] std::size_t weight_count() const { return storage_.size(); }

  // Builds from a float storage laid out in llama2.c order (see docs/refworker.md).
  // `storage` must have exactly llama2c_float_count(config, with_freq_cis) elements.
  [[nodiscard]] static Result<Model> from_storage(const ModelConfig& config, std::vector<float> storage,
                                                  bool with_freq_cis, std::string weights_identity);

 private:
  Model() = default;

  ModelConfig config_;
  ModelFingerprint fingerprint_;
  std::vector<float> storage_;
  std::vector<LayerWeights> layers_;
  std::size_t embedding_offset_ = 0;
  std::size_t rms_final_offset_ = 0;
  std::size_t classifier_offset_ = 0;
};

// Floats a llama2.c checkpoint body holds for `config` (everything after the 28-byte header).
[[nodiscard]] Result<std::uint64_t> llama2c_float_count(const ModelConfig& config, bool with_freq_cis);

// Loads a llama2.c legacy .bin checkpoint. Validates the header, the exact file size and that
// every weight is finite; the weights identity is the xxh3-64 of the whole file in hex.
[[nodiscard]] Result<Model> load_llama2c(const std::filesystem::path& path);

// Seeded synthetic weights: uniform with fan-in scaling so activations stay finite at any depth,
// and the same shapes (hence the same prefill cost) as a trained model. Identity
// "synthetic:<shape>:<seed>".
[[nodiscard]] Result<Model> make_synthetic(const ModelConfig& config, std::uint64_t seed);

}  // namespace kvrelay::refworker
