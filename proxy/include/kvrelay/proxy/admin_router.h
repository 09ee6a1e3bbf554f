#pragma once

// Admin and health endpoints are declared as one table of method, access class, path, help
// text and a handler that is a pure function from request to response; the router owns no I/O.
// It checks each request's credential against the serving policy's admin section before the
// handler runs, and logs every mutating request (who, what, and what it changed).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/proxy/admin_auth.h"
#include "kvrelay/proxy/http_types.h"

namespace kvrelay::proxy {

using RequestHandler = std::function<HttpResponse(const HttpRequest&)>;

struct AdminEndpoint {
  http::verb method;
  Access access;     // who may call it (admin_auth.h); every row says, none is implied by the method
  std::string path;  // exact path; a trailing "*" matches any suffix ("/admin/routes/*")
  std::string help;
  RequestHandler handler;
};

// The policy whose admin section each request is checked against, read per request so that a
// reload rotates the token.
using AdminPolicySource = std::function<std::shared_ptr<const Policy>()>;

class AdminRouter {
 public:
  AdminRouter(std::vector<AdminEndpoint> endpoints, AdminPolicySource policy);

  // 404 for an unknown path, 405 (with Allow) for a known path with another method, 401/403
  // when the credential does not allow the endpoint's access class.
  [[nodiscard]] HttpResponse handle(const HttpRequest& request) const;

  // JSON listing of the table, served at GET /admin unless the table declares that path itself.
  [[nodiscard]] std::string describe_json() const;

  [[nodiscard]] const std::vector<AdminEndpoint>& endpoints() const { return endpoints_; }

 private:
  [[nodiscard]] HttpResponse serve(const AdminEndpoint& endpoint, const HttpRequest& request,
                                   std::string_view path) const;

  std::vector<AdminEndpoint> endpoints_;
  AdminPolicySource policy_;
};

[[nodiscard]] bool path_matches(std::string_view pattern, std::string_view path) noexcept;

}  // namespace kvrelay::proxy
