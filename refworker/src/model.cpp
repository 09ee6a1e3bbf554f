#include "kvrelay/refworker/model.h"

#include <fmt/format.h>

#include <cmath>

namespace kvrelay::refworker {

namespace {

// Offsets (in floats) of each tensor group in llama2.c order.
struct Llama2cOffsets {
  std::uint64_t embedding = 0;
  std::uint64_t rms_att = 0;
  std::uint64_t wq = 0;
  std::uint64_t wk = 0;
  std::uint64_t wv = 0;
  std::uint64_t wo = 0;
  std::uint64_t rms_ffn = 0;
  std::uint64_t w1 = 0;
  std::uint64_t w2 = 0;
  std::uint64_t w3 = 0;
  std::uint64_t rms_final = 0;
  std::uint64_t classifier = 0;
  std::uint64_t total = 0;
};

Result<Llama2cOffsets> compute_offsets(const ModelConfig& config, bool with_freq_cis) {
  KVRELAY_TRY(config.validate());
  const std::uint64_t dim = config.dim;
  const std::uint64_t layers = config.layers;
  const std::uint64_t hidden = config.hidden_dim;
  const std::uint64_t kv_dim = config.kv_dim();
  Llama2cOffsets offsets;
  std::uint64_t cursor = 0;
  // Appends `count` floats and records where they start; all products are overflow-checked.
  auto place = [&cursor](std::uint64_t& field, std::uint64_t a, std::uint64_t b, std::uint64_t c) -> Status {
    KVRELAY_TRY(const auto ab, checked_mul(a, b));
    KVRELAY_TRY(const auto abc, checked_mul(ab, c));
    field = cursor;
    KVRELAY_TRY(cursor, checked_add(cursor, abc));
    return ok();
  };
  KVRELAY_TRY(place(offsets.embedding, config.vocab_size, dim, 1));
  KVRELAY_TRY(place(offsets.rms_att, layers, dim, 1));
  KVRELAY_TRY(place(offsets.wq, layers, dim, dim));
  KVRELAY_TRY(place(offsets.wk, layers, kv_dim, dim));
  KVRELAY_TRY(place(offsets.wv, layers, kv_dim, dim));
  KVRELAY_TRY(place(offsets.wo, layers, dim, dim));
  KVRELAY_TRY(place(offsets.rms_ffn, layers, dim, 1));
  KVRELAY_TRY(place(offsets.w1, layers, hidden, dim));
  KVRELAY_TRY(place(offsets.w2, layers, dim, hidden));
  KVRELAY_TRY(place(offsets.w3, layers, hidden, dim));
  KVRELAY_TRY(place(offsets.rms_final, dim, 1, 1));
  if (with_freq_cis) {
    std::uint64_t unused = 0;
    // freq_cis_real and freq_cis_imag: seq_len * head_dim / 2 floats each.
    KVRELAY_TRY(place(unused, config.seq_len, config.head_dim(), 1));
  }
  if (config.shared_classifier) {
    offsets.classifier = offsets.embedding;
  } else {
    KVRELAY_TRY(place(offsets.classifier, config.vocab_size, dim, 1));
  }
  offsets.total = cursor;
  return offsets;
}

}  // namespace

Result<std::uint64_t> llama2c_float_count(const ModelConfig& config, bool with_freq_cis) {
  KVRELAY_TRY(const auto offsets, compute_offsets(config, with_freq_cis));
  return offsets.total;
}

Result<Model> Model::from_storage(const ModelConfig& config, std::vector<float> storage, bool with_freq_cis,
                                  std::string weights_identity) {
  KVRELAY_TRY(const auto offsets, compute_offsets(config, with_freq_cis));
  if (storage.size() != offsets.total) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("weight storage has {} floats, shape {} needs {}", storage.size(),
                            config.shape_string(), offsets.total));
  }
  Model model;
  model.config_ = config;
  model.storage_ = std::move(storage);
  model.embedding_offset_ = offsets.embedding;
  model.rms_final_offset_ = offsets.rms_final;
  model.classifier_offset_ = offsets.classifier;
  const float* base = model.storage_.data();
  const std::size_t dim = config.dim;
  const std::size_t kv_dim = config.kv_dim();
  const std::size_t hidden = config.hidden_dim;
  model.layers_.resize(config.layers);
  for (std::size_t l = 0; l < config.layers; ++l) {
    LayerWeights& layer = model.layers_[l];
    layer.rms_att = base + offsets.rms_att + l * dim;
    layer.wq = base + offsets.wq + l * dim * dim;
    layer.wk = base + offsets.wk + l * kv_dim * dim;
    layer.wv = base + offsets.wv + l * kv_dim * dim;
    layer.wo = base + offsets.wo + l * dim * dim;
    layer.rms_ffn = base + offsets.rms_ffn + l * dim;
    layer.w1 = base + offsets.w1 + l * hidden * dim;
    layer.w2 = base + offsets.w2 + l * dim * hidden;
    layer.w3 = base + offsets.w3 + l * hidden * dim;
  }
  model.fingerprint_ = ModelFingerprint{"llama", config.layers, config.kv_heads, config.head_dim(), DType::kFloat32,
                                        std::move(weights_identity)};
  return model;
}

}  // namespace kvrelay::refworker
