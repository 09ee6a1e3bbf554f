#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace kvrelay::refworker {

struct SamplingOptions {
  float temperature = 0.0F;  // <= 0: greedy (argmax)
  std::uint32_t top_k = 0;   // 0: whole vocabulary
  std::uint64_t seed = 0;
};

// Greedy or temperature sampling with its own seeded RNG, so a request with a seed is
// reproducible regardless of what else the worker served.
class Sampler {
 public:
  explicit Sampler(SamplingOptions options) : options_(options), rng_(options.seed) {}

  [[nodiscard]] std::int32_t sample(std::span<const float> logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

[[nodiscard]] std::int32_t argmax(std::span<const float> logits);

// softmax(logits) in place-free form, for reporting probabilities.
void softmax_into(std::span<const float> logits, std::span<float> probabilities);

}  // namespace kvrelay::refworker
