#include "kvrelay/proxy/front_proxy.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <random>

#include "kvrelay/broker/request_context.h"
#include "kvrelay/broker/request_signature.h"
#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/decision/media.h"
#include "kvrelay/proxy/summary_prompt.h"
#include "kvrelay/proxy/upstream_relay.h"

#include "summariser.h"

namespace kvrelay::proxy {

namespace {

constexpr std::string_view kAgentsPrefix = "/agents/";

// Endpoints of the OpenAI API that the front proxy forwards; anything else is a 404, so a typo in
// a framework's base URL fails loudly instead of reaching the worker.
bool is_forwarded_endpoint(http::verb method, std::string_view path) {
  path = path.substr(0, path.find('?'));
  if (method == http::verb::post) return path == "/v1/completions" || path == "/v1/chat/completions";
  if (method == http::verb::get) return path == "/v1/models";
  return false;
}

bool is_generation_endpoint(std::string_view path) {
  path = path.substr(0, path.find('?'));
  return path == "/v1/completions" || path == "/v1/chat/completions";
}

}  // namespace

std::optional<AgentRequestTarget> parse_agent_target(std::string_view target) {
  if (target.substr(0, kAgentsPrefix.size()) != kAgentsPrefix) return std::nullopt;
  const auto rest = target.substr(kAgentsPrefix.size());
  const auto slash = rest.find('/');
  if (slash == std::string_view::npos || slash == 0) return std::nullopt;
  return AgentRequestTarget{std::string(rest.substr(0, slash)), std::string(rest.substr(slash))};
}

std::string generate_request_id() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return fmt::format("{:016x}{:016x}", generator(), generator());
}

namespace {

// The request's cache salt: vLLM's top-level cache_salt, else kv_transfer_params.cache_salt.
Result<std::string> request_cache_salt(const nlohmann::json& document, const nlohmann::json& params) {
  for (const auto* holder : {&document, &params}) {
    const auto it = holder->find("cache_salt");
    if (it == holder->end() || it->is_null()) continue;
    if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
      return fail(ErrorCode::kInvalidArgument, "cache_salt must be a non-empty string");
    }
    return it->get<std::string>();
  }
  return std::string();
}

}  // namespace

Result<std::string> summariser_scoped_body(const Policy& policy, const RoutePolicy& route, const HttpUrl& summariser,
                                           const std::string& request_id, std::string_view b_body,
                                           std::string summariser_body) {
  const auto* from = policy.find_agent(route.from_agent);
  if (from == nullptr || !from->kv_connector || !(summariser == from->upstream)) return summariser_body;
  // A's own worker publishes the KV it computes for the span: as A's request would, in A's tenant
  // scope and under B's cache salt, never in another tenant's scope or unsalted.
  auto document = nlohmann::json::parse(summariser_body, nullptr, /*allow_exceptions=*/false);
  const auto b_document = nlohmann::json::parse(b_body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object()) return summariser_body;
  if (b_document.is_object()) {
    const auto params = b_document.find("kv_transfer_params");
    KVRELAY_TRY(const auto salt, request_cache_salt(b_document, params != b_document.end() && params->is_object()
                                                                    ? *params
                                                                    : nlohmann::json::object()));
    if (!salt.empty()) document["cache_salt"] = salt;
  }
  broker::RequestContext context;
  context.request_id = request_id + "-summary";
  context.agent = from->id;
  context.node = policy.node_id;
  context.tenant = from->tenant;
  const auto* tenant = policy.find_tenant(from->tenant);
  const KvParamsInjection injection{false, tenant != nullptr ? tenant->salt : std::string_view(),
                                    policy.signing.node_key};
  KVRELAY_TRY(auto injected,
              inject_kv_transfer_params(document.dump(), broker::request_context_json(context), injection));
  return std::move(injected.body);
}

Result<InjectedBody> inject_kv_transfer_params(std::string_view body, nlohmann::json kvrelay,
                                               const KvParamsInjection& options) {
  nlohmann::json document = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) return fail(ErrorCode::kInvalidArgument, "request body is not valid JSON");
  if (!document.is_object()) return fail(ErrorCode::kInvalidArgument, "request body must be a JSON object");
  auto& params = document["kv_transfer_params"];
  if (params.is_null()) params = nlohmann::json::object();
  if (!params.is_object()) return fail(ErrorCode::kInvalidArgument, "kv_transfer_params must be a JSON object");
  if (!kvrelay.is_object()) return fail(ErrorCode::kInternal, "the injected kvrelay fields are not an object");
  // The answer's length budget prices a lossy medium's extra decode for the decision engine.
  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    if (const auto budget = document.find(field);
        budget != document.end() && budget->is_number_unsigned() && !kvrelay.contains("max_tokens")) {
      kvrelay["max_tokens"] = *budget;
    }
  }
  KVRELAY_TRY(const auto cache_salt, request_cache_salt(document, params));
  if (const auto root = broker::derive_chain_root(options.tenant_salt, cache_salt); root != kRootBlockHash) {
    kvrelay["chain_root"] = block_hash_hex(root);
  }
  InjectedBody injected;
  if (const auto client = params.find("kvrelay"); client != params.end() && client->is_object()) {
    if (const auto treatment = client->find("treatment"); treatment != client->end()) {
      if (options.client_treatment_allowed && !kvrelay.contains("treatment")) {
        kvrelay["treatment"] = *treatment;
      } else {
        injected.client_treatment_dropped = true;
      }
    }
    // The client's hint of who reads this KV next (prefetch); the sidecar checks it against routes.
    if (const auto next = client->find("next_agents");
        next != client->end() && next->is_array() &&
        std::all_of(next->begin(), next->end(), [](const auto& id) { return id.is_string(); })) {
      kvrelay["next_agents"] = *next;
    }
  }
  if (!options.node_key.empty()) broker::sign_request_context(kvrelay, options.node_key);
  params["kvrelay"] = std::move(kvrelay);
  injected.body = document.dump();
  return injected;
}

std::uint64_t prompt_token_count(std::string_view body) {
  const auto document = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object()) return 0;
  const auto prompt = document.find("prompt");
  if (prompt == document.end() || !prompt->is_array()) return 0;
  for (const auto& token : *prompt) {
    if (!token.is_number_integer()) return 0;
  }
  return prompt->size();
}

namespace {

// A client (the offline audit runner) that names its own treatment is not randomized again.
bool client_sent_treatment(std::string_view body) {
  const auto document = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object()) return false;
  const auto params = document.find("kv_transfer_params");
  if (params == document.end() || !params->is_object()) return false;
  const auto kvrelay = params->find("kvrelay");
  return kvrelay != params->end() && kvrelay->is_object() && kvrelay->contains("treatment");
}

// The offline audit's runner names its treatments; only routes that say so take them.
bool client_treatments_allowed(const Policy& policy, const std::string& agent_id) {
  return std::any_of(policy.routes.begin(), policy.routes.end(), [&](const RoutePolicy& route) {
    return route.to_agent == agent_id && route.enabled && route.audit.client_treatments;
  });
}

const RoutePolicy* audited_route_into(const Policy& policy, const std::string& agent_id) {
  for (const auto& route : policy.routes) {
    if (route.to_agent == agent_id && route.enabled && route.audit.fraction > 0.0) return &route;
  }
  return nullptr;
}

constexpr std::size_t kWorkerStatsTailBytes = 2048;

bool is_completions_endpoint(std::string_view path) {
  return path.substr(0, path.find('?')) == "/v1/completions";
}

// The route a request into the agent is handled on when no treatment names one: the KV path's
// pick_route over the candidate routes the proxy injects (the enabled routes into the agent).
const RoutePolicy* first_route_into(const Policy& policy, const std::string& agent_id) {
  for (const auto& route : policy.routes) {
    if (route.to_agent == agent_id && route.enabled) return &route;
  }
  return nullptr;
}

// Whether a request into the agent may be summarised at all: only then does the proxy keep the
// client's body beside the one it forwards.
bool summary_possible_into(const Policy& policy, const std::string& agent_id) {
  return std::any_of(policy.routes.begin(), policy.routes.end(), [&](const RoutePolicy& route) {
    if (route.to_agent != agent_id || !route.enabled) return false;
    return route_allows_summary(route) ||
           std::any_of(route.audit.treatments.begin(), route.audit.treatments.end(),
                       [](const Treatment& treatment) { return treatment.medium == kSummaryMedium; });
  });
}

// The summary medium's fidelity factor: the policy's calibration, else the catalogue's default.
double summary_fidelity(const Policy& policy) {
  const MediumCostModel* model = policy.cost_model.medium(kSummaryMedium);
  return model != nullptr && model->fidelity ? *model->fidelity
                                             : decision::builtin_medium(kSummaryMedium).profile.fidelity;
}

std::int64_t now_unix_millis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct FrontProxy::PlannedSummary {
  const RoutePolicy* route = nullptr;  // in the request's policy snapshot
  std::string source;                  // forced, treatment, engine
  SummarisablePrompt prompt;
  SummarySpan span;
  HttpUrl summariser;
  nlohmann::json record;  // the summary record's fields known before the call
};

namespace {

// B's body with the summary in place of the span, injected as the original was (its kvrelay
// fields saying so); the record gains the summary's size. An error says why B gets its original.
Result<std::string> summarised_body(const Result<SummariserResponse>& answer, const FrontProxy::PlannedSummary& planned,
                                    const std::string& client_body, std::optional<broker::RequestContext>& context,
                                    const std::optional<KvParamsInjection>& injection, nlohmann::json& record) {
  if (!answer) return answer.error();
  record["summariser_status"] = answer.value().status;
  KVRELAY_TRY(const Summary summary,
              parse_summariser_reply(answer.value().status, answer.value().body, planned.prompt.kind));
  const bool token_ids = planned.prompt.kind == PromptKind::kTokenIds;
  const std::uint64_t summary_tokens = token_ids ? summary.tokens.size() : summary.completion_tokens;
  record["summary_tokens"] = summary_tokens;
  record["bytes"] = summary_bytes(summary, planned.prompt.kind);
  KVRELAY_TRY(auto body, body_with_summary(client_body, planned.prompt, planned.span, summary,
                                           planned.route->summary.prompt_template));
  if (token_ids) record["b_prompt_tokens"] = summary_tokens + planned.prompt.tokens.size() - planned.span.tokens;
  if (!context || !injection) return body;
  context->summary = broker::SummaryApplied{planned.span.tokens, summary_tokens, planned.span.chars, planned.source};
  KVRELAY_TRY(auto injected, inject_kv_transfer_params(body, broker::request_context_json(*context), *injection));
  return std::move(injected.body);
}

}  // namespace

std::optional<FrontProxy::PlannedSummary> FrontProxy::plan_summary(const std::shared_ptr<const Policy>& policy,
                                                                   const AgentPolicy& agent, const RoutePolicy* route,
                                                                   const std::optional<Treatment>& treatment,
                                                                   const std::string& request_id,
                                                                   std::string_view body) {
  if (route == nullptr) return std::nullopt;
  PlannedSummary planned;
  planned.route = route;
  // The order the KV path's choose_medium keeps: treatment, forced medium, engine.
  if (treatment && treatment->decides_medium()) {
    if (treatment->delivered_medium() != kSummaryMedium) return std::nullopt;
    planned.source = "treatment";
  } else if (route->forced_medium) {
    if (*route->forced_medium != kSummaryMedium) return std::nullopt;
    planned.source = "forced";
  } else if (route_allows_summary(*route) && summary_hooks_.predict) {
    planned.source = "engine";
  } else {
    return std::nullopt;
  }
  // The engine only prices what it can have; a forced or drawn summary that cannot be made is
  // recorded, and B gets its request as it is (the tokens medium).
  const bool wanted = planned.source != "engine";
  planned.record = {{"kind", "summary"},
                    {"time_unix_ms", now_unix_millis()},
                    {"route", route->id},
                    {"request_id", request_id},
                    {"agent", agent.id},
                    {"source", planned.source},
                    {"budget_tokens", route->summary.max_tokens}};
  const auto skip = [&](const std::string& why) -> std::optional<PlannedSummary> {
    if (!wanted) return std::nullopt;
    planned.record["outcome"] = "skipped";
    planned.record["error"] = why;
    spdlog::warn("front proxy: request {} on route {}: not summarised ({}): {}", request_id, route->id, planned.source,
                 why);
    if (summary_hooks_.record) summary_hooks_.record(std::move(planned.record), route->id, "skipped", std::nullopt);
    return std::nullopt;
  };
  const double fidelity = summary_fidelity(*policy);
  if (route->quality_floor > 0.0 && fidelity < route->quality_floor) {
    return skip(fmt::format("the summary's fidelity {:.3g} is below route {}'s quality_floor {:.3g}", fidelity,
                            route->id, route->quality_floor));
  }
  const auto* from = policy->find_agent(route->from_agent);
  if (from == nullptr) return skip("the route's sender is not in the policy");
  auto parsed = summarisable_prompt(body);
  if (!parsed) return skip(parsed.error().message);
  planned.prompt = std::move(parsed).value();
  const SummarisablePrompt& prompt = planned.prompt;
  std::uint64_t receiver_cached = 0;
  if (prompt.kind == PromptKind::kTokenIds) {
    planned.record["prompt"] = "token_ids";
    if (prompt.handoff_tokens) {
      planned.span.tokens = std::min<std::uint64_t>(*prompt.handoff_tokens, prompt.tokens.size());
      planned.record["span_from"] = "handoff_tokens";
    } else if (summary_hooks_.handoff_span) {
      const auto* tenant = policy->find_tenant(agent.tenant);
      const BlockHash root =
          broker::derive_chain_root(tenant != nullptr ? tenant->salt : std::string_view(), prompt.cache_salt);
      const auto answer = summary_hooks_.handoff_span(HandoffQuery{*policy, *route, prompt.tokens, root, agent.tenant});
      planned.span.tokens = answer.tokens;
      receiver_cached = std::min(answer.receiver_cached, answer.tokens);
      planned.record["span_from"] = "published_kv";
    }
    if (planned.span.tokens == 0) {
      return skip(
          fmt::format("no leading block of B's prompt is KV that {} published (and no "
                      "kv_transfer_params.kvrelay.handoff_tokens)",
                      route->from_agent));
    }
  } else {
    planned.record["prompt"] = "text";
    if (!prompt.handoff_chars) {
      return skip("a text prompt is summarised only with kv_transfer_params.kvrelay.handoff_chars");
    }
    auto span = text_span(prompt.text, *prompt.handoff_chars);
    if (!span) return skip(span.error().message);
    planned.span = span.value();
    planned.record["span_chars"] = *planned.span.chars;
  }
  planned.record["span_tokens"] = planned.span.tokens;
  if (summary_hooks_.predict) {
    decision::TransferShape shape;
    shape.tokens = planned.span.tokens;
    shape.receiver_cached = receiver_cached;
    if (prompt.max_tokens) shape.expected_output_tokens = *prompt.max_tokens;
    shape.dtype = from->model.dtype;
    nlohmann::json cost;
    const auto chosen = summary_hooks_.predict(*policy, *route, shape, cost);
    if (!cost.is_null()) planned.record["cost"] = std::move(cost);
    if (!wanted && (!chosen || *chosen != kSummaryMedium)) return std::nullopt;
  }
  planned.summariser = route->summary.summariser.value_or(from->upstream);
  planned.record["summariser"] = planned.summariser.to_string() + "/v1/completions";
  return planned;
}

FrontProxyMetrics::FrontProxyMetrics(metrics::Registry& registry)
    : requests(registry.counter("kvrelay_proxy_requests_total",
                                "Requests through the front proxy by agent, endpoint and status",
                                {"agent", "endpoint", "status"})),
      time_to_first_byte(registry.histogram("kvrelay_proxy_time_to_first_byte_seconds",
                                            "Time from forwarding a request to the upstream's first response byte",
                                            {"agent"}, metrics::latency_buckets_seconds())),
      latency(registry.histogram("kvrelay_proxy_request_duration_seconds",
                                 "Total time of a proxied request, last byte included", {"agent"},
                                 metrics::latency_buckets_seconds())),
      upstream_errors(registry.counter("kvrelay_proxy_upstream_errors_total",
                                       "Upstream failures by agent and kind (connect, timeout, read, write, client)",
                                       {"agent", "kind"})),
      in_flight(registry.gauge("kvrelay_proxy_requests_in_flight", "Proxied requests not yet finished")),
      client_treatments_dropped(
          registry.counter("kvrelay_proxy_client_treatments_dropped_total",
                           "Treatments clients named in kv_transfer_params.kvrelay that no route into the agent "
                           "allows (routes[].audit.client_treatments), dropped, by agent",
                           {"agent"})) {}

FrontProxy::FrontProxy(std::shared_ptr<const RuntimePolicy> policy, metrics::Registry& registry,
                       std::shared_ptr<OnlineAudit> audit, std::shared_ptr<broker::Deliveries> deliveries)
    : policy_(std::move(policy)),
      pool_(std::make_shared<UpstreamPool>()),
      metrics_(registry),
      audit_(std::move(audit)),
      deliveries_(std::move(deliveries)) {}

DeliveredTreatment delivered_treatment(const RoutePolicy& route, const Treatment& assigned,
                                       const std::optional<broker::Delivery>& delivery) {
  if (!delivery) {
    if (assigned.span == KvSpan::kNone) return {assigned.name, {}};
    broker::Delivery nothing;
    nothing.reason = "the worker made no KV lookup for this request";
    return delivered_treatment(route, assigned, nothing);
  }
  if (delivery->as_assigned) return {assigned.name, {}};
  for (const Treatment& candidate : route.audit.treatments) {
    const bool same_span = candidate.span == delivery->span;
    if (same_span && (delivery->span == KvSpan::kNone || candidate.delivered_medium() == delivery->medium)) {
      return {candidate.name, delivery->reason};
    }
  }
  if (delivery->span == KvSpan::kNone) return {"tokens/none", delivery->reason};
  return {fmt::format("{}/{}", delivery->medium, span_name(delivery->span)), delivery->reason};
}

Reply FrontProxy::dispatch(HttpRequest&& request) {
  const auto target = parse_agent_target(request.target());
  const auto version = request.version();
  const bool keep_alive = request.keep_alive();
  if (!target) {
    return make_json_error(http::status::not_found, "not_found",
                           fmt::format("no endpoint at {}", std::string(request.target())), version, keep_alive);
  }
  const auto policy = policy_->current();  // this request keeps this snapshot to its end
  const auto* agent = policy->find_agent(target->agent);
  if (agent == nullptr) {
    return make_json_error(http::status::not_found, "unknown_agent",
                           fmt::format("agent '{}' is not in this sidecar's policy", target->agent), version,
                           keep_alive);
  }
  if (!is_forwarded_endpoint(request.method(), target->upstream_path)) {
    return make_json_error(
        http::status::not_found, "not_found",
        fmt::format("{} {} is not an endpoint kvrelay forwards (completions, chat/completions, models)",
                    std::string(request.method_string()), target->upstream_path),
        version, keep_alive);
  }

  std::string request_id(request["X-Request-Id"]);
  if (request_id.empty()) request_id = generate_request_id();

  bool audited = false;
  std::optional<Treatment> assigned;  // an audited request's treatment, and the route it was drawn on
  const RoutePolicy* audited_route = nullptr;
  // Where a summary may replace A's context (docs/summary.md), the client's body is kept beside
  // the injected one, with what was injected, so that the summary's body is injected alike.
  const bool may_summarise =
      is_completions_endpoint(target->upstream_path) && summary_possible_into(*policy, agent->id);
  std::string client_body;
  std::optional<broker::RequestContext> injected_context;
  std::optional<KvParamsInjection> injected_with;
  if (agent->kv_connector && is_generation_endpoint(target->upstream_path)) {
    broker::RequestContext context;
    context.request_id = request_id;
    context.agent = agent->id;
    context.node = policy->node_id;
    for (const auto& route : policy->routes) {
      if (route.to_agent == agent->id && route.enabled) context.routes.push_back(route.id);
    }
    context.tenant = agent->tenant;
    const bool client_treatments = client_treatments_allowed(*policy, agent->id);
    const RoutePolicy* route = audit_ ? audited_route_into(*policy, agent->id) : nullptr;
    const bool keeps_client_treatment = client_treatments && client_sent_treatment(request.body());
    const auto treatment = route != nullptr && !keeps_client_treatment ? audit_->draw(*route) : std::nullopt;
    if (treatment) {
      audit::Trial covariates;
      covariates.context_tokens = prompt_token_count(request.body());
      covariates.receiver_agent = agent->id;
      covariates.receiver_model = agent->model.weights_identity;
      if (const auto* sender = policy->find_agent(route->from_agent)) {
        covariates.sender_model = sender->model.weights_identity;
      }
      covariates.load = metrics_.in_flight.get().value();
      // The assignment is on disk before the request leaves (no post-hoc selection).
      audit_->record_assignment(*route, request_id, *treatment, std::move(covariates));
      context.treatment = *treatment;
      context.route = route->id;  // the lookup applies the treatment under the route it was drawn on
      audited = true;
      assigned = *treatment;
      audited_route = route;
    }
    const auto* tenant = policy->find_tenant(agent->tenant);
    const KvParamsInjection injection{client_treatments, tenant != nullptr ? tenant->salt : std::string_view(),
                                      policy->signing.node_key};
    auto body = inject_kv_transfer_params(request.body(), broker::request_context_json(context), injection);
    if (body && body.value().client_treatment_dropped) {
      metrics_.client_treatments_dropped.with({agent->id}).inc();
      spdlog::warn(
          "front proxy: request {} to agent {}: dropped the client's kv_transfer_params.kvrelay.treatment "
          "(no route into the agent sets audit.client_treatments)",
          request_id, agent->id);
    }
    if (!body) {
      if (audited) audit_->record_outcome(request_id, AuditOutcome{0.0, 0.0, 400, {}, {}});
      metrics_.requests.with({agent->id, target->upstream_path, "400"}).inc();
      return make_json_error(http::status::bad_request, "invalid_request_error", body.error().message, version,
                             keep_alive);
    }
    if (may_summarise) {
      client_body = std::exchange(request.body(), std::move(body).value().body);
      injected_context = std::move(context);
      injected_with = injection;
    } else {
      request.body() = std::move(body).value().body;
    }
  }
  std::optional<PlannedSummary> summary;
  if (may_summarise) {
    if (!injected_context) client_body = request.body();
    const RoutePolicy* route = audited_route != nullptr ? audited_route : first_route_into(*policy, agent->id);
    summary = plan_summary(policy, *agent, route, assigned, request_id, client_body);
  }

  HttpRequest upstream_request{request.method(), agent->upstream.base_path + target->upstream_path, 11};
  for (const auto& field : request) {
    // Host and Content-Length are set for the upstream request below.
    const auto name = field.name();
    if (is_hop_by_hop(name) || name == http::field::host || name == http::field::content_length) continue;
    upstream_request.insert(field.name_string(), field.value());
  }
  upstream_request.set(http::field::host, fmt::format("{}:{}", agent->upstream.host, agent->upstream.port));
  upstream_request.set("X-Request-Id", request_id);
  upstream_request.keep_alive(true);
  upstream_request.body() = std::move(request.body());
  upstream_request.prepare_payload();

  metrics_.in_flight.get().inc();
  // Set when B's request leaves with a summary in it (the summary relay's step).
  auto summarised = std::make_shared<std::optional<broker::SummaryApplied>>();
  auto on_finished = [this, agent_id = agent->id, endpoint = target->upstream_path, audited, request_id, policy,
                      audited_route, assigned, summarised](const RelayOutcome& outcome) {
    if (audited) {
      AuditOutcome result;
      if (audited_route != nullptr && assigned) {
        auto delivery = deliveries_ ? deliveries_->take(request_id) : std::nullopt;
        // A worker that made no lookup still got the summary the proxy put in its prompt.
        if (!delivery && *summarised) delivery = broker::summary_delivery(*assigned, **summarised);
        auto delivered = delivered_treatment(*audited_route, *assigned, delivery);
        result.delivered_treatment = std::move(delivered.name);
        result.delivery_reason = std::move(delivered.reason);
        const bool answered = !outcome.upstream_failed && outcome.status >= 200 && outcome.status < 300;
        if (delivery && answered && audit_observer_) {
          audit_observer_(audited_route->id, *delivery,
                          std::chrono::duration<double>(outcome.time_to_first_body_byte).count());
        }
      }
      // Time to first token: the first body byte (for SSE the first token's event; for a plain
      // response the whole answer, which is why audits stream).
      result.ttft_ms = std::chrono::duration<double, std::milli>(outcome.time_to_first_body_byte).count();
      result.e2e_ms = std::chrono::duration<double, std::milli>(outcome.total).count();
      result.status = outcome.upstream_failed ? 502U : outcome.status;
      if (const auto stats = worker_stats_from_tail(outcome.body_tail)) {
        if (const auto it = stats->find("prompt_tokens"); it != stats->end() && it->is_number_unsigned()) {
          result.prompt_tokens = it->get<std::uint64_t>();
        }
        if (const auto it = stats->find("cached_tokens"); it != stats->end() && it->is_number_unsigned()) {
          result.cached_tokens = it->get<std::uint64_t>();
        }
      }
      audit_->record_outcome(request_id, result);
    }
    metrics_.in_flight.get().dec();
    metrics_.requests.with({agent_id, endpoint, std::to_string(outcome.status)}).inc();
    if (outcome.upstream_failed || !outcome.error_kind.empty()) {
      metrics_.upstream_errors.with({agent_id, outcome.error_kind}).inc();
    }
    if (!outcome.upstream_failed) {
      metrics_.time_to_first_byte.with({agent_id})
          .observe(std::chrono::duration<double>(outcome.time_to_first_byte).count());
    }
    metrics_.latency.with({agent_id}).observe(std::chrono::duration<double>(outcome.total).count());
  };
  const std::size_t tail_bytes = audited ? kWorkerStatsTailBytes : 0;
  if (!summary) {
    return make_upstream_relay(pool_, agent->upstream, std::move(upstream_request), keep_alive,
                               policy->limits.upstream_timeout, std::move(on_finished), tail_bytes);
  }
  const RouteSummaryPolicy& settings = summary->route->summary;
  auto summariser_body = summariser_scoped_body(*policy, *summary->route, summary->summariser, request_id, client_body,
                                                summariser_request_body(summary->prompt, summary->span, settings));
  if (!summariser_body) {
    return make_json_error(http::status::bad_request, "invalid_request_error", summariser_body.error().message, version,
                           keep_alive);
  }
  SummaryStep step;
  step.call = SummariserCall{summary->summariser, std::move(summariser_body).value(), settings.timeout};
  // `policy` keeps the snapshot that planned.route and the injection's salt and key point into.
  step.body_for_b = [record_summary = summary_hooks_.record, policy, planned = std::move(*summary),
                     client_body = std::move(client_body), context = std::move(injected_context),
                     injection = injected_with, summarised,
                     request_id](Result<SummariserResponse> answer,
                                 std::chrono::steady_clock::duration waited) mutable -> std::optional<std::string> {
    const double seconds = std::chrono::duration<double>(waited).count();
    const RoutePolicy& route = *planned.route;
    nlohmann::json record = std::move(planned.record);
    record["summariser_ms"] = seconds * 1000.0;
    auto rewritten = summarised_body(answer, planned, client_body, context, injection, record);
    if (rewritten) {
      record["outcome"] = "summarised";
      *summarised = context ? context->summary
                            : std::optional<broker::SummaryApplied>(broker::SummaryApplied{
                                  planned.span.tokens, record.value("summary_tokens", std::uint64_t{0}),
                                  planned.span.chars, planned.source});
      if (record_summary) record_summary(std::move(record), route.id, "summarised", seconds);
      return std::move(rewritten).value();
    }
    record["outcome"] = "failed";
    record["error"] = rewritten.error().message;
    spdlog::warn("front proxy: request {} on route {}: summary failed, B gets its request as sent: {}", request_id,
                 route.id, rewritten.error().message);
    if (record_summary) record_summary(std::move(record), route.id, "failed", std::nullopt);
    return std::nullopt;
  };
  return make_summary_relay(std::move(step), pool_, agent->upstream, std::move(upstream_request), keep_alive,
                            policy->limits.upstream_timeout, std::move(on_finished), tail_bytes);
}

}  // namespace kvrelay::proxy
