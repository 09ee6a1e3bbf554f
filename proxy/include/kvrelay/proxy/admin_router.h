#pragma once

// Admin and health endpoints are declared as one table of method, path, help text and a
// handler that is a pure function from request to response; the router owns no I/O.

#include <functional>
#include <string>
#include <vector>

#include "kvrelay/proxy/http_types.h"

namespace kvrelay::proxy {

using RequestHandler = std::function<HttpResponse(const HttpRequest&)>;

struct AdminEndpoint {
  http::verb method;
  std::string path;  // exact path; a trailing "*" matches any suffix ("/admin/routes/*")
  std::string help;
  RequestHandler handler;
};

class AdminRouter {
 public:
  explicit AdminRouter(std::vector<AdminEndpoint> endpoints);

  // 404 for an unknown path, 405 (with Allow) for a known path with another method.
  [[nodiscard]] HttpResponse handle(const HttpRequest& request) const;

  // JSON listing of the table, served at GET /admin unless the table declares that path itself.
  [[nodiscard]] std::string describe_json() const;

  [[nodiscard]] const std::vector<AdminEndpoint>& endpoints() const { return endpoints_; }

 private:
  std::vector<AdminEndpoint> endpoints_;
};

[[nodiscard]] bool path_matches(std::string_view pattern, std::string_view path) noexcept;

}  // namespace kvrelay::proxy
