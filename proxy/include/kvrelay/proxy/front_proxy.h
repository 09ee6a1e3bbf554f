#pragma once

// The OpenAI-compatible front: /agents/{agent}/v1/{completions,chat/completions,models} are
// forwarded to the agent's upstream from the policy, streamed back chunk by chunk.

#include <nlohmann/json.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvrelay/broker/deliveries.h"
#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/decision/decision_engine.h"
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

// What the front proxy asks the KV path about a handoff it may send as a summary of A's context
// (issue #28, docs/summary.md); the daemon wires them to broker::KvPath. Each may be empty: then
// only the client's hints give a span, the engine is never asked, and summaries are only logged.
struct HandoffQuery {
  const Policy& policy;
  const RoutePolicy& route;
  std::span<const TokenId> prompt;  // B's prompt
  BlockHash chain_root = kRootBlockHash;
  const std::string& tenant;
};
struct HandoffSpanAnswer {
  std::uint64_t tokens = 0;           // leading tokens of B's prompt that A's published KV covers
  std::uint64_t receiver_cached = 0;  // of them, what B could take from this node's store as it is
};
struct SummaryHooks {
  std::function<HandoffSpanAnswer(const HandoffQuery&)> handoff_span;
  // The engine's medium for the handoff without a state change, its breakdown into `cost`.
  std::function<std::optional<std::string>(const Policy&, const RoutePolicy&, const decision::TransferShape&,
                                           nlohmann::json& cost)>
      predict;
  // A summary made, failed or skipped: the decision log, kvrelay_summaries_total and, with the
  // summariser's seconds, the engine's estimate of it.
  std::function<void(nlohmann::json record, const std::string& route, std::string_view outcome,
                     std::optional<double> summariser_seconds)>
      record;
};

struct FrontProxyMetrics {
  explicit FrontProxyMetrics(metrics::Registry& registry);
  metrics::Family<metrics::Counter>& requests;
  metrics::Family<metrics::Histogram>& time_to_first_byte;
  metrics::Family<metrics::Histogram>& latency;
  metrics::Family<metrics::Counter>& upstream_errors;
  metrics::Family<metrics::Gauge>& in_flight;
  metrics::Family<metrics::Counter>& client_treatments_dropped;
};

class FrontProxy {
 public:
  // With `audit`, routes that set an audit fraction get randomized treatments (online_audit.h);
  // with `deliveries`, each trial's outcome says what the KV path delivered of its treatment.
  FrontProxy(std::shared_ptr<const RuntimePolicy> policy, metrics::Registry& registry,
             std::shared_ptr<OnlineAudit> audit = nullptr, std::shared_ptr<broker::Deliveries> deliveries = nullptr);

  // Returns a streaming relay for agent requests, or an immediate JSON error (404 unknown agent,
  // 404 unknown endpoint, 400 malformed JSON body).
  [[nodiscard]] Reply dispatch(HttpRequest&& request);
  // Called when an audited request ends with what its lookup delivered and its time to first
  // token (the KV path's live calibration). Set before serving.
  using AuditObserver = std::function<void(const std::string& route, const broker::Delivery&, double ttft_s)>;
  void set_audit_observer(AuditObserver observer) { audit_observer_ = std::move(observer); }
  // Set before serving.
  void set_summary_hooks(SummaryHooks hooks) { summary_hooks_ = std::move(hooks); }
  struct PlannedSummary;  // a summary about to be asked for (front_proxy.cpp)

 private:
  // Whether this request's handoff goes as a summary (docs/summary.md): the drawn treatment's
  // medium, else the route's forced medium, else the engine's prediction where the route allows
  // one; with the span it replaces and the summariser's request. nullopt: B's request as it is
  // (a summary wanted but impossible is recorded as skipped).
  [[nodiscard]] std::optional<PlannedSummary> plan_summary(const std::shared_ptr<const Policy>& policy,
                                                           const AgentPolicy& agent, const RoutePolicy* route,
                                                           const std::optional<Treatment>& treatment,
                                                           const std::string& request_id, std::string_view body);

  std::shared_ptr<const RuntimePolicy> policy_;
  std::shared_ptr<UpstreamPool> pool_;
  FrontProxyMetrics metrics_;
  std::shared_ptr<OnlineAudit> audit_;
  std::shared_ptr<broker::Deliveries> deliveries_;
  AuditObserver audit_observer_;
  SummaryHooks summary_hooks_;
};

// The summariser's request body: when the summariser is the route's sender's own worker (the
// default), with that agent's kvrelay fields injected (its tenant's chain root, signed) and B's
// cache_salt, so the KV it publishes for the span stays in A's tenant scope; else as it is.
[[nodiscard]] Result<std::string> summariser_scoped_body(const Policy& policy, const RoutePolicy& route,
                                                         const HttpUrl& summariser, const std::string& request_id,
                                                         std::string_view b_body, std::string summariser_body);

// The treatment a trial was delivered (issue #28): the assigned one when the lookup delivered it,
// else the route's treatment with the delivered span and medium (span none: the one moving no
// KV), else "<medium>/<span>". No recorded lookup: nothing moved.
struct DeliveredTreatment {
  std::string name;
  std::string reason;  // "" when as assigned
};
[[nodiscard]] DeliveredTreatment delivered_treatment(const RoutePolicy& route, const Treatment& assigned,
                                                     const std::optional<broker::Delivery>& delivery);

// How the front proxy completes the kvrelay object it injects (docs/security.md).
struct KvParamsInjection {
  bool client_treatment_allowed = false;  // a route into the agent sets audit.client_treatments
  std::string_view tenant_salt;           // the agent's tenant's salt; "" for the default tenant
  std::string_view node_key;              // signs the object; "" leaves it unsigned
};

struct InjectedBody {
  std::string body;
  bool client_treatment_dropped = false;  // the client named a treatment that was not allowed
};

// Sets kv_transfer_params.kvrelay of a JSON request body to `kvrelay` plus the request's answer
// budget, the chain root of the tenant salt and the request's cache_salt (top level, as in vLLM's
// OpenAI API, else kv_transfer_params.cache_salt), a treatment the client put in
// kv_transfer_params.kvrelay where `options` allow it (how an offline audit forces one), and the
// signature over all of that. Every other field the client put in kv_transfer_params.kvrelay is
// replaced; the rest of kv_transfer_params is kept. Errors name what is wrong with the body.
[[nodiscard]] Result<InjectedBody> inject_kv_transfer_params(std::string_view body, nlohmann::json kvrelay,
                                                             const KvParamsInjection& options = {});

// Prompt length of a completions request whose prompt is token ids (0 when it is text).
[[nodiscard]] std::uint64_t prompt_token_count(std::string_view body);

// 32 hex digits from a CSPRNG-seeded generator.
[[nodiscard]] std::string generate_request_id();

}  // namespace kvrelay::proxy
