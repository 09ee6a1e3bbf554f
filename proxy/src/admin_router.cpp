#include "kvrelay/proxy/admin_router.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

namespace kvrelay::proxy {

namespace {

// A logged response body: what the handler produced (JSON, so no raw control characters),
// cut so that one request cannot flood the log.
std::string_view log_excerpt(std::string_view body) {
  constexpr std::size_t kMaxLoggedBody = 2048;
  while (!body.empty() && body.back() == '\n')
    body.remove_suffix(1);
  return body.substr(0, kMaxLoggedBody);
}

}  // namespace

bool path_matches(std::string_view pattern, std::string_view path) noexcept {
  if (!pattern.empty() && pattern.back() == '*') {
    const auto prefix = pattern.substr(0, pattern.size() - 1);
    return path.size() > prefix.size() && path.substr(0, prefix.size()) == prefix;
  }
  return pattern == path;
}

AdminRouter::AdminRouter(std::vector<AdminEndpoint> endpoints, AdminPolicySource policy)
    : endpoints_(std::move(endpoints)), policy_(std::move(policy)) {}

HttpResponse AdminRouter::handle(const HttpRequest& request) const {
  std::string_view target = request.target();
  target = target.substr(0, target.find('?'));
  std::string allowed;
  for (const auto& endpoint : endpoints_) {
    if (!path_matches(endpoint.path, target)) continue;
    if (endpoint.method == request.method()) return serve(endpoint, request, target);
    if (!allowed.empty()) allowed += ", ";
    allowed += std::string(http::to_string(endpoint.method));
  }
  if (allowed.empty() && request.method() == http::verb::get && (target == "/admin" || target == "/admin/")) {
    static const AdminEndpoint kListing{http::verb::get, Access::kRead, "/admin", "this listing", {}};
    return serve(kListing, request, target);
  }
  if (!allowed.empty()) {
    auto response = make_json_error(http::status::method_not_allowed, "method_not_allowed",
                                    fmt::format("{} does not accept {}", target, std::string(request.method_string())),
                                    request.version(), request.keep_alive());
    response.set(http::field::allow, allowed);
    return response;
  }
  return make_json_error(http::status::not_found, "not_found", fmt::format("no endpoint at {}", target),
                         request.version(), request.keep_alive());
}

HttpResponse AdminRouter::serve(const AdminEndpoint& endpoint, const HttpRequest& request,
                                std::string_view path) const {
  const auto policy = policy_();
  auto authorization = authorize_admin(request, endpoint.access, policy->admin);
  const bool mutating = endpoint.access == Access::kMutate;
  // The path only: a query string is the client's and could carry anything.
  const auto method = std::string(request.method_string());
  // Changes are logged at warn, so that the trail survives logging.level "warn".
  if (!authorization.allowed) {
    if (mutating) {
      spdlog::warn("admin change refused: {} {} by {}: {}", method, path, authorization.credential,
                   authorization.refusal.result_int());
    }
    return std::move(authorization.refusal);
  }
  auto response =
      endpoint.handler ? endpoint.handler(request) : make_json_response(http::status::ok, describe_json(), request);
  if (mutating) {
    spdlog::warn("admin change by {}: {} {} -> {}: {}", authorization.credential, method, path, response.result_int(),
                 log_excerpt(response.body()));
  }
  return response;
}

std::string AdminRouter::describe_json() const {
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& endpoint : endpoints_) {
    listing.push_back({{"method", std::string(http::to_string(endpoint.method))},
                       {"access", access_name(endpoint.access)},
                       {"path", endpoint.path},
                       {"help", endpoint.help}});
  }
  return nlohmann::json{{"endpoints", listing}}.dump(2);
}

}  // namespace kvrelay::proxy
