#include "kvrelay/proxy/admin_router.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace kvrelay::proxy;

namespace {

constexpr const char* kToken = "router-test-token-0123456789";

// A policy whose admin section has `token` ("" configures none).
AdminPolicySource policy_with_token(const std::string& token, bool require_token_for_reads = false) {
  auto policy = std::make_shared<kvrelay::Policy>();
  policy->admin.token = token;
  policy->admin.token_file = token.empty() ? "" : "/dev/null";
  policy->admin.require_token_for_reads = require_token_for_reads;
  std::shared_ptr<const kvrelay::Policy> snapshot = std::move(policy);
  return [snapshot] { return snapshot; };
}

AdminRouter sample_router(AdminPolicySource policy = policy_with_token(kToken)) {
  return AdminRouter(
      {
          {http::verb::get, Access::kPublic, "/healthz", "liveness",
           [](const HttpRequest& r) { return make_json_response(http::status::ok, R"({"status":"ok"})", r); }},
          {http::verb::get, Access::kRead, "/admin/routes", "routes",
           [](const HttpRequest& r) { return make_json_response(http::status::ok, "[]", r); }},
          {http::verb::put, Access::kMutate, "/admin/routes/*", "change a route",
           [](const HttpRequest& r) { return make_json_response(http::status::ok, std::string(r.target()), r); }},
      },
      std::move(policy));
}

HttpRequest request(http::verb method, const char* target, const std::string& authorization = {}) {
  HttpRequest req{method, target, 11};
  req.keep_alive(true);
  if (!authorization.empty()) req.set(http::field::authorization, authorization);
  return req;
}

HttpRequest with_token(http::verb method, const char* target) {
  // Built by append, not std::string("Bearer ") + kToken: in some unity batches GCC 12 flags that
  // operator+ with a false -Warray-bounds.
  std::string authorization = "Bearer ";
  authorization += kToken;
  return request(method, target, authorization);
}

}  // namespace

TEST_CASE("router dispatches exact and prefix paths, ignoring the query", "[proxy][admin]") {
  const auto router = sample_router();
  CHECK(router.handle(request(http::verb::get, "/healthz?verbose=1")).result() == http::status::ok);
  const auto routed = router.handle(with_token(http::verb::put, "/admin/routes/r1"));
  CHECK(routed.result() == http::status::ok);
  CHECK(routed.body() == "/admin/routes/r1");
  CHECK(router.handle(with_token(http::verb::put, "/admin/routes/")).result() == http::status::not_found);
}

TEST_CASE("router answers 405 with Allow for a known path and 404 with JSON otherwise", "[proxy][admin]") {
  const auto router = sample_router();
  const auto wrong_method = router.handle(request(http::verb::post, "/healthz"));
  CHECK(wrong_method.result() == http::status::method_not_allowed);
  CHECK(wrong_method[http::field::allow] == "GET");
  const auto missing = router.handle(request(http::verb::get, "/nope"));
  CHECK(missing.result() == http::status::not_found);
  const auto body = nlohmann::json::parse(missing.body());
  CHECK(body["error"]["message"] == "no endpoint at /nope");
  CHECK(body["error"]["code"] == 404);
}

TEST_CASE("router describes its table", "[proxy][admin]") {
  const auto listing = nlohmann::json::parse(sample_router().describe_json());
  REQUIRE(listing["endpoints"].size() == 3);
  CHECK(listing["endpoints"][2]["path"] == "/admin/routes/*");
  CHECK(listing["endpoints"][2]["method"] == "PUT");
  CHECK(listing["endpoints"][2]["access"] == "mutate");
  CHECK(listing["endpoints"][2]["help"] == "change a route");
  CHECK(listing["endpoints"][0]["access"] == "public");
}

TEST_CASE("a path that is not UTF-8 gets a JSON 404, not an exception (found by fuzz_http_request)", "[proxy][admin]") {
  const auto router = sample_router();
  const auto missing = router.handle(with_token(http::verb::put, "/\xff\xffmin/routes/r1"));
  CHECK(missing.result() == http::status::not_found);
  const auto body = nlohmann::json::parse(missing.body());  // valid JSON: the bad bytes are replaced
  CHECK(body["error"]["message"] == "no endpoint at /\xEF\xBF\xBD\xEF\xBF\xBDmin/routes/r1");
}

TEST_CASE("a mutating endpoint needs the bearer token: 401 with a challenge without it, 403 when none is configured",
          "[proxy][admin][auth]") {
  const auto router = sample_router();
  const std::vector<std::string> wrong{"", "Bearer wrong-token-0123456789",
                                       "Basic cm91dGVyOnRlc3Q=", std::string("Bearer ") + kToken + "x", "Bearer"};
  for (const auto& authorization : wrong) {
    INFO("Authorization: " << authorization);
    const auto refused = router.handle(request(http::verb::put, "/admin/routes/r1", authorization));
    CHECK(refused.result() == http::status::unauthorized);
    const auto challenge = refused[http::field::www_authenticate];
    CHECK_THAT(std::string(challenge.data(), challenge.size()), Catch::StartsWith("Bearer"));
    const auto body = nlohmann::json::parse(refused.body());
    CHECK(body["error"]["code"] == 401);
    CHECK(refused.body().find(kToken) == std::string::npos);
  }
  CHECK(router.handle(with_token(http::verb::put, "/admin/routes/r1")).result() == http::status::ok);
  // The scheme is case-insensitive (RFC 6750 uses RFC 7235's auth-scheme).
  CHECK(router.handle(request(http::verb::put, "/admin/routes/r1", std::string("bearer ") + kToken)).result() ==
        http::status::ok);
  // Reads and health need nothing unless the policy says so.
  CHECK(router.handle(request(http::verb::get, "/admin/routes")).result() == http::status::ok);
  CHECK(router.handle(request(http::verb::get, "/healthz")).result() == http::status::ok);

  const auto read_only = sample_router(policy_with_token(""));
  const auto forbidden = read_only.handle(with_token(http::verb::put, "/admin/routes/r1"));
  CHECK(forbidden.result() == http::status::forbidden);
  CHECK_THAT(nlohmann::json::parse(forbidden.body())["error"]["message"].get<std::string>(),
             Catch::Contains("read-only") && Catch::Contains("/admin/token_file"));
  CHECK(read_only.handle(request(http::verb::get, "/admin/routes")).result() == http::status::ok);
}

TEST_CASE("require_token_for_reads guards reads, never the health probes", "[proxy][admin][auth]") {
  const auto router = sample_router(policy_with_token(kToken, true));
  CHECK(router.handle(request(http::verb::get, "/admin/routes")).result() == http::status::unauthorized);
  CHECK(router.handle(request(http::verb::get, "/admin")).result() == http::status::unauthorized);
  CHECK(router.handle(with_token(http::verb::get, "/admin/routes")).result() == http::status::ok);
  CHECK(router.handle(with_token(http::verb::get, "/admin")).result() == http::status::ok);
  CHECK(router.handle(request(http::verb::get, "/healthz")).result() == http::status::ok);
}

TEST_CASE("secrets compare by digest and are labelled without being shown", "[proxy][admin][auth]") {
  CHECK(same_secret(kToken, kToken));
  CHECK_FALSE(same_secret(kToken, std::string(kToken) + "0"));
  CHECK_FALSE(same_secret("", kToken));
  const auto label = admin_token_label(kToken);
  CHECK_THAT(label, Catch::StartsWith("admin-token sha256:"));
  CHECK(label.size() == std::string("admin-token sha256:").size() + 8);
  CHECK(label.find(kToken) == std::string::npos);
  CHECK(label != admin_token_label("another-token-0123456789"));
}
