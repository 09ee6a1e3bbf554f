#pragma once

// What a request carries for the KV path, kv_transfer_params.kvrelay: the front proxy writes it
// (to_json) into the request it forwards, and the KV path reads it back (parse_request_context)
// from the worker's lookups, publishes and prefill reports. One type for both ends.

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::broker {

// The front proxy replaced the leading part of this request's prompt (A's context) by a summary
// (docs/summary.md): its length in tokens (for a text prompt, its characters and an estimate of
// its tokens) and the summary's.
struct SummaryApplied {
  std::uint64_t span_tokens = 0;
  std::uint64_t summary_tokens = 0;
  std::optional<std::uint64_t> span_chars;  // text prompts only
  std::string source;                       // why: forced, treatment or engine
  friend bool operator==(const SummaryApplied&, const SummaryApplied&) = default;
};

struct RequestContext {
  std::string request_id;
  std::string agent;
  std::string node;                 // the sidecar that forwarded the request
  std::string route;                // explicit route id, if the caller named one
  std::vector<std::string> routes;  // the front proxy's candidate routes into this agent
  std::optional<Treatment> treatment;
  std::optional<std::uint32_t> max_tokens;  // the request's answer budget, when the client set one
  std::string tenant;                       // the receiving agent's tenant; "" = the default tenant
  // Where the request's block-hash chain starts (tenant_chain.h); absent: kRootBlockHash.
  std::optional<BlockHash> chain_root;
  // The agents the client says read this request's KV next (issue #27): a publish prefetches
  // to those that are the destinations of this agent's routes; the rest are ignored.
  std::vector<std::string> next_agents;
  // Set when B's prompt carries a summary in place of A's context: a lookup serves it no KV.
  std::optional<SummaryApplied> summary;
};

// "" parses to an empty context. Fields it does not know (the signature) are ignored. Every field is type-checked;
// errors name the field. A treatment without a medium keeps the route's choice, without a span moves all of A's KV.
[[nodiscard]] Result<RequestContext> parse_request_context(std::string_view params_json);
// The same, of the kvrelay object already parsed (null: an empty context).
[[nodiscard]] Result<RequestContext> request_context_from_json(const nlohmann::json& params);
// The kvrelay object as the front proxy injects it (empty fields left out).
[[nodiscard]] nlohmann::json request_context_json(const RequestContext& context);
[[nodiscard]] nlohmann::json treatment_json(const Treatment& treatment);
[[nodiscard]] nlohmann::json summary_applied_json(const SummaryApplied& summary);
// A treatment object of kv_transfer_params.kvrelay (a client's own, or the proxy's).
[[nodiscard]] Result<Treatment> parse_treatment(const nlohmann::json& value);

}  // namespace kvrelay::broker
