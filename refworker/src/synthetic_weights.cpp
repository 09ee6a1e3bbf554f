#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <new>

#include "kvrelay/refworker/model.h"

namespace kvrelay::refworker {

namespace {

// splitmix64: fast, seedable, good enough for weights; each tensor group gets its own stream
// so the values do not depend on how the storage is walked.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float symmetric() { return static_cast<float>(next() >> 40) * (2.0F / 16777216.0F) - 1.0F; }

 private:
  std::uint64_t state_;
};

void fill_uniform(float* data, std::size_t count, float scale, std::uint64_t seed) {
  SplitMix64 rng(seed);
  for (std::size_t i = 0; i < count; ++i) data[i] = scale * rng.symmetric();
}

}  // namespace

Result<Model> make_synthetic(const ModelConfig& input_config, std::uint64_t seed) {
  ModelConfig config = input_config;
  config.shared_classifier = true;
  KVRELAY_TRY(const std::uint64_t floats, llama2c_float_count(config, false));
  // Checked up front: filling more than physical memory would swap or get the process killed,
  // and sanitizer allocators abort on absurd sizes instead of throwing.
  const auto pages = ::sysconf(_SC_PHYS_PAGES);
  const auto page_size = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0 &&
      floats / static_cast<std::uint64_t>(page_size) * sizeof(float) > static_cast<std::uint64_t>(pages)) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("shape {} needs {} GiB of weights, more than this host's memory", config.shape_string(),
                            floats * sizeof(float) >> 30));
  }
  std::vector<float> storage;
  try {
    storage.resize(floats);
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("shape {} needs {} GiB of weights; cannot allocate them", config.shape_string(),
                            floats * sizeof(float) >> 30));
  }
  const std::size_t dim = config.dim;
  const std::size_t layers = config.layers;
  const std::size_t kv_dim = config.kv_dim();
  const std::size_t hidden = config.hidden_dim;
  // Uniform(-a, a) has variance a^2/3: a = sqrt(3 / fan_in) keeps each projection's output at
  // the scale of its input; the residual branches are scaled down by depth so the stream stays
  // bounded (the usual GPT-2 style init), and RMSNorm gains are 1.
  const float in_scale = std::sqrt(3.0F / static_cast<float>(dim));
  const float hidden_scale = std::sqrt(3.0F / static_cast<float>(hidden));
  const float residual = 1.0F / std::sqrt(2.0F * static_cast<float>(layers));
  float* cursor = storage.data();
  std::uint64_t stream = seed * 0x100000001B3ULL;
  auto fill = [&](std::size_t count, float scale) {
    fill_uniform(cursor, count, scale, ++stream);
    cursor += count;
  };
  auto fill_ones = [&](std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) cursor[i] = 1.0F;
    cursor += count;
  };
  fill(config.vocab_size * dim, 1.0F);
  fill_ones(layers * dim);
  fill(layers * dim * dim, in_scale);
  fill(layers * kv_dim * dim, in_scale);
  fill(layers * kv_dim * dim, in_scale);
  fill(layers * dim * dim, in_scale * residual);
  fill_ones(layers * dim);
  fill(layers * hidden * dim, in_scale);
  fill(layers * dim * hidden, hidden_scale * residual);
  fill(layers * hidden * dim, in_scale);
  fill_ones(dim);
  return Model::from_storage(config, std::move(storage), false,
                             fmt::format("synthetic:{}:{}", config.shape_string(), seed));
}

}  // namespace kvrelay::refworker
