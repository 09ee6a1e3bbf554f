#include "kvrelay/refworker/generation.h"

namespace kvrelay::refworker {

Result<GenerationResult> generate(InferenceSession& session, std::span<const float> first_logits,
                                  const GenerationOptions& options, const TokenCallback& on_token) {
  GenerationResult result;
  Sampler sampler(options.sampling);
  std::vector<float> logits(first_logits.begin(), first_logits.end());
  const std::uint64_t seq_len = session.model().config().seq_len;
  for (std::uint32_t i = 0; i < options.max_tokens; ++i) {
    const std::int32_t token = sampler.sample(logits);
    result.tokens.push_back(token);
    if (on_token && !on_token(token)) return fail(ErrorCode::kCancelled, "generation cancelled by the caller");
    if (options.stop_at_eos && token == kEosToken) {
      result.finish_reason = FinishReason::kStop;
      break;
    }
    if (i + 1 == options.max_tokens) break;
    if (session.position() >= seq_len) break;  // context full: finish with "length"
    KVRELAY_TRY(logits, session.decode(token));
  }
  return result;
}

}  // namespace kvrelay::refworker
