#include "kvrelay/broker/request_context.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "kvrelay/core/policy.h"

namespace kvrelay::broker {

namespace {

using nlohmann::json;

constexpr std::size_t kMaxLabelText = 128;
constexpr std::size_t kMaxNextAgents = 16;  // more are ignored: a hint, not a fan-out

auto context_type_error(std::string_view field, std::string_view expected, const json& got) {
  return fail(ErrorCode::kInvalidArgument,
              fmt::format("kv_transfer_params.kvrelay.{}: expected {}, got {}", field, expected, got.dump()));
}

Status read_label(const json& object, std::string_view field, std::string& out) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return ok();
  if (!it->is_string()) return context_type_error(field, "a string", *it);
  out = it->get<std::string>().substr(0, kMaxLabelText);
  return ok();
}

}  // namespace

Result<Treatment> parse_treatment(const json& value) {
  if (!value.is_object()) return context_type_error("treatment", "an object", value);
  Treatment treatment;
  treatment.medium.clear();  // absent: the route's choice
  treatment.span = KvSpan::kAll;
  std::string span;
  KVRELAY_TRY(read_label(value, "name", treatment.name));
  KVRELAY_TRY(read_label(value, "medium", treatment.medium));
  KVRELAY_TRY(read_label(value, "span", span));
  if (!treatment.medium.empty() && !is_known_medium(treatment.medium)) {
    return context_type_error("treatment.medium", "a medium name", value["medium"]);
  }
  if (!span.empty()) {
    const auto parsed = parse_span(span);
    if (!parsed) return context_type_error("treatment.span", "none, prompt, generated or all", value["span"]);
    treatment.span = *parsed;
  }
  if (const auto it = value.find("prompt_tokens"); it != value.end() && !it->is_null()) {
    if (!it->is_number_unsigned()) {
      return context_type_error("treatment.prompt_tokens", "a non-negative integer", *it);
    }
    treatment.prompt_tokens = it->get<std::uint64_t>();
  }
  return treatment;
}

json treatment_json(const Treatment& treatment) {
  json out{{"name", treatment.name}, {"medium", treatment.medium}, {"span", span_name(treatment.span)}};
  if (treatment.prompt_tokens) out["prompt_tokens"] = *treatment.prompt_tokens;
  return out;
}

json summary_applied_json(const SummaryApplied& summary) {
  json out{{"span_tokens", summary.span_tokens}, {"summary_tokens", summary.summary_tokens}};
  if (summary.span_chars) out["span_chars"] = *summary.span_chars;
  if (!summary.source.empty()) out["source"] = summary.source;
  return out;
}

Result<RequestContext> parse_request_context(std::string_view params_json) {
  if (params_json.empty()) return RequestContext{};
  const json params = json::parse(params_json, nullptr, false);
  if (params.is_discarded()) return fail(ErrorCode::kInvalidArgument, "kv_transfer_params.kvrelay is not valid JSON");
  return request_context_from_json(params);
}

Result<RequestContext> request_context_from_json(const json& params) {
  RequestContext context;
  if (params.is_null()) return context;
  if (!params.is_object()) return context_type_error("", "an object", params);
  KVRELAY_TRY(read_label(params, "request_id", context.request_id));
  KVRELAY_TRY(read_label(params, "agent", context.agent));
  KVRELAY_TRY(read_label(params, "node", context.node));
  KVRELAY_TRY(read_label(params, "route", context.route));
  if (const auto it = params.find("routes"); it != params.end() && !it->is_null()) {
    if (!it->is_array()) return context_type_error("routes", "an array of route ids", *it);
    for (const auto& route : *it) {
      if (!route.is_string()) return context_type_error("routes[]", "a route id", route);
      context.routes.push_back(route.get<std::string>().substr(0, kMaxLabelText));
    }
  }
  if (const auto it = params.find("next_agents"); it != params.end() && !it->is_null()) {
    if (!it->is_array()) return context_type_error("next_agents", "an array of agent ids", *it);
    for (const auto& agent : *it) {
      if (!agent.is_string()) return context_type_error("next_agents[]", "an agent id", agent);
      if (context.next_agents.size() < kMaxNextAgents)
        context.next_agents.push_back(agent.get<std::string>().substr(0, kMaxLabelText));
    }
  }
  if (const auto it = params.find("max_tokens"); it != params.end() && !it->is_null()) {
    if (!it->is_number_unsigned()) return context_type_error("max_tokens", "a non-negative integer", *it);
    context.max_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(it->get<std::uint64_t>(), UINT32_MAX));
  }
  if (const auto it = params.find("treatment"); it != params.end() && !it->is_null()) {
    auto treatment = parse_treatment(*it);
    if (!treatment) return treatment.error();
    context.treatment = std::move(treatment).value();
  }
  if (const auto it = params.find("summary"); it != params.end() && !it->is_null()) {
    if (!it->is_object()) return context_type_error("summary", "an object", *it);
    SummaryApplied summary;
    for (const auto& [field, out] :
         {std::pair{"span_tokens", &summary.span_tokens}, std::pair{"summary_tokens", &summary.summary_tokens}}) {
      const auto value = it->find(field);
      if (value == it->end() || !value->is_number_unsigned()) {
        return context_type_error(std::string("summary.") + field, "a non-negative integer",
                                  value == it->end() ? json() : *value);
      }
      *out = value->get<std::uint64_t>();
    }
    if (const auto chars = it->find("span_chars"); chars != it->end() && !chars->is_null()) {
      if (!chars->is_number_unsigned())
        return context_type_error("summary.span_chars", "a non-negative integer", *chars);
      summary.span_chars = chars->get<std::uint64_t>();
    }
    KVRELAY_TRY(read_label(*it, "source", summary.source));
    context.summary = summary;
  }
  KVRELAY_TRY(read_label(params, "tenant", context.tenant));
  if (const auto it = params.find("chain_root"); it != params.end() && !it->is_null()) {
    const auto root = it->is_string() ? parse_block_hash_hex(it->get_ref<const std::string&>()) : std::nullopt;
    if (!root) return context_type_error("chain_root", "16 hex digits", *it);
    context.chain_root = *root;
  }
  return context;
}

json request_context_json(const RequestContext& context) {
  json out = json::object();
  const auto put = [&](const char* key, const std::string& value) {
    if (!value.empty()) out[key] = value;
  };
  put("request_id", context.request_id);
  put("agent", context.agent);
  put("node", context.node);
  put("route", context.route);
  if (!context.routes.empty()) out["routes"] = context.routes;
  if (context.treatment) out["treatment"] = treatment_json(*context.treatment);
  if (context.max_tokens) out["max_tokens"] = *context.max_tokens;
  if (!context.next_agents.empty()) out["next_agents"] = context.next_agents;
  put("tenant", context.tenant);
  if (context.chain_root) out["chain_root"] = block_hash_hex(*context.chain_root);
  if (context.summary) out["summary"] = summary_applied_json(*context.summary);
  return out;
}

}  // namespace kvrelay::broker
