#include "kv_admin.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <charconv>

namespace kvrelay::proxy {

namespace {

// limit=N from the query string; N in 1..capacity.
Result<std::size_t> parse_limit(std::string_view target, std::size_t capacity) {
  const auto query_start = target.find('?');
  if (query_start == std::string_view::npos) return std::min(kDefaultDecisionLimit, capacity);
  std::string_view query = target.substr(query_start + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (!pair.starts_with("limit=")) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown query parameter '{}' (allowed: limit)", pair));
    }
    const auto text = pair.substr(6);
    std::size_t limit = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), limit);
    if (ec != std::errc() || end != text.data() + text.size() || limit == 0 || limit > capacity) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("limit: expected an integer 1..{}, got '{}'", capacity, text));
    }
    return limit;
  }
  return std::min(kDefaultDecisionLimit, capacity);
}

}  // namespace

std::vector<AdminEndpoint> kv_admin_endpoints(std::shared_ptr<broker::KvPath> path) {
  return {
      {http::verb::get, Access::kRead, "/admin/decisions",
       "Recent KV-path decisions, newest first (?limit=N): route, request, medium, source, cost breakdown, outcome",
       [path](const HttpRequest& request) {
         const auto limit = parse_limit(request.target(), path->decisions().capacity());
         if (!limit) {
           return make_json_error(http::status::bad_request, "invalid_argument", limit.error().message,
                                  request.version(), request.keep_alive());
         }
         const nlohmann::json body{{"decisions", path->decisions().recent(limit.value())}};
         return make_json_response(http::status::ok,
                                   body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), request);
       }},
      {http::verb::delete_, Access::kMutate, "/admin/kv",
       "Drop every KV entry this sidecar holds (benchmarks, incident response); returns what was dropped",
       [path](const HttpRequest& request) {
         const auto dropped = path->clear_store();
         const nlohmann::json body{{"dropped_entries", dropped.entries}, {"dropped_bytes", dropped.bytes}};
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      {http::verb::get, Access::kRead, "/admin/peers",
       "Peers: connection state, link RTT and throughput estimates, summaries",
       [path](const HttpRequest& request) {
         return make_json_response(http::status::ok, path->peers().describe().dump(), request);
       }},
  };
}

}  // namespace kvrelay::proxy
