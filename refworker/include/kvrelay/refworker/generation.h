#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/sampler.h"
#include "kvrelay/refworker/session.h"

namespace kvrelay::refworker {

inline constexpr std::int32_t kBosToken = 1;
inline constexpr std::int32_t kEosToken = 2;

struct GenerationOptions {
  std::uint32_t max_tokens = 16;
  SamplingOptions sampling;
  bool stop_at_eos = true;
};

enum class FinishReason { kLength, kStop };

struct GenerationResult {
  std::vector<std::int32_t> tokens;
  FinishReason finish_reason = FinishReason::kLength;
};

// Called after each sampled token; returning false stops generation (client went away).
using TokenCallback = std::function<bool(std::int32_t token)>;

// Continues `session` from the logits of its last prefill: samples, feeds each token back with
// decode(). The sampled tokens' KV is in the session afterwards, except the very last one's,
// which has not been run (as in any engine: its KV comes with the next step).
[[nodiscard]] Result<GenerationResult> generate(InferenceSession& session, std::span<const float> first_logits,
                                                const GenerationOptions& options,
                                                const TokenCallback& on_token = {});

}  // namespace kvrelay::refworker
