#include "kvrelay/proxy/admin_router.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvrelay::proxy {

bool path_matches(std::string_view pattern, std::string_view path) noexcept {
  if (!pattern.empty() && pattern.back() == '*') {
    const auto prefix = pattern.substr(0, pattern.size() - 1);
    return path.size() > prefix.size() && path.substr(0, prefix.size()) == prefix;
  }
  return pattern == path;
}

AdminRouter::AdminRouter(std::vector<AdminEndpoint> endpoints) : endpoints_(std::move(endpoints)) {}

HttpResponse AdminRouter::handle(const HttpRequest& request) const {
  std::string_view target = request.target();
  target = target.substr(0, target.find('?'));
  std::string allowed;
  for (const auto& endpoint : endpoints_) {
    if (!path_matches(endpoint.path, target)) continue;
    if (endpoint.method == request.method()) return endpoint.handler(request);
    if (!allowed.empty()) allowed += ", ";
    allowed += std::string(http::to_string(endpoint.method));
  }
  if (allowed.empty() && request.method() == http::verb::get && (target == "/admin" || target == "/admin/")) {
    return make_json_response(http::status::ok, describe_json(), request);
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

std::string AdminRouter::describe_json() const {
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& endpoint : endpoints_) {
    listing.push_back(
        {{"method", std::string(http::to_string(endpoint.method))}, {"path", endpoint.path}, {"help", endpoint.help}});
  }
  return nlohmann::json{{"endpoints", listing}}.dump(2);
}

}  // namespace kvrelay::proxy
