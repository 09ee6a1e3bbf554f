#include "kvrelay/refworker/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvrelay::refworker {

std::int32_t argmax(std::span<const float> logits) {
  // First maximum wins, as in llama2.c.
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<std::int32_t>(best);
}

void softmax_into(std::span<const float> logits, std::span<float> probabilities) {
  const float max_value = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    probabilities[i] = std::exp(logits[i] - max_value);
    sum += probabilities[i];
  }
  for (float& p : probabilities) p = static_cast<float>(p / sum);
}

std::int32_t Sampler::sample(std::span<const float> logits) {
  if (options_.temperature <= 0.0F || logits.size() == 1) return argmax(logits);
  std::vector<std::size_t> order(logits.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::size_t keep = logits.size();
  if (options_.top_k > 0 && options_.top_k < logits.size()) {
    keep = options_.top_k;
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                      [&logits](std::size_t a, std::size_t b) { return logits[a] > logits[b]; });
  }
  float max_value = logits[order[0]];
  for (std::size_t i = 1; i < keep; ++i) max_value = std::max(max_value, logits[order[i]]);
  std::vector<double> weights(keep);
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    weights[i] = std::exp(static_cast<double>(logits[order[i]] - max_value) / options_.temperature);
    total += weights[i];
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double target = uniform(rng_);
  for (std::size_t i = 0; i < keep; ++i) {
    target -= weights[i];
    if (target <= 0.0) return static_cast<std::int32_t>(order[i]);
  }
  return static_cast<std::int32_t>(order[keep - 1]);
}

}  // namespace kvrelay::refworker
