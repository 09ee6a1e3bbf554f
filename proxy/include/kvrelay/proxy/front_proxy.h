#pragma once

// The OpenAI-compatible front: /agents/{agent}/v1/{completions,chat/completions,models} are
// forwarded to the agent's upstream from the policy, streamed back chunk by chunk.

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/proxy/online_audit.h"
#include "kvrelay/proxy/runtime_policy.h"
#include "kvrelay/proxy/streaming_responder.h"
#include "kvrelay/proxy/upstream_pool.h"

namespace kvrelay::proxy {

struct AgentRequestTarget {
  std::string agent;
  std::string upstream_path;  // "/v1/completions" (query string kept)
};

// Splits "/agents/{agent}/v1/..." ; nullopt for any other target.
[[nodiscard]] std::optional<AgentRequestTarget> parse_agent_target(std::string_view target);

struct FrontProxyMetrics {
  explicit FrontProxyMetrics(metrics::Registry& registry);
  metrics::Family<metrics::Counter>& requests;
  metrics::Family<metrics::Histogram>& time_to_first_byte;
  metrics::Family<metrics::Histogram>& latency;
  metrics::Family<metrics::Counter>& upstream_errors;
  metrics::Family<metrics::Gauge>& in_flight;
};

class FrontProxy {
 public:
  // With `audit`, routes that set an audit fraction get randomized treatments (online_audit.h).
  FrontProxy(std::shared_ptr<const RuntimePolicy> policy, metrics::Registry& registry,
             std::shared_ptr<OnlineAudit> audit = nullptr);

  // Returns a streaming relay for agent requests, or an immediate JSON error (404 unknown agent,
  // 404 unknown endpoint, 400 malformed JSON body).
  [[nodiscard]] Reply dispatch(HttpRequest&& request);

 private:
  std::shared_ptr<const RuntimePolicy> policy_;
  std::shared_ptr<UpstreamPool> pool_;
  FrontProxyMetrics metrics_;
  std::shared_ptr<OnlineAudit> audit_;
};

// Adds kv_transfer_params.kvrelay = `params` to a JSON request body (keeping anything the client
// put in kv_transfer_params, and a treatment the client put in kv_transfer_params.kvrelay: that
// is how an offline audit forces one). Errors name what is wrong with the body.
[[nodiscard]] Result<std::string> inject_kv_transfer_params(std::string_view body, const std::string& params_json);

// Prompt length of a completions request whose prompt is token ids (0 when it is text).
[[nodiscard]] std::uint64_t prompt_token_count(std::string_view body);

// 32 hex digits from a CSPRNG-seeded generator.
[[nodiscard]] std::string generate_request_id();

}  // namespace kvrelay::proxy
