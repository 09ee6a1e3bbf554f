#include "kvrelay/proxy/admin_router.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace kvrelay::proxy;

namespace {

AdminRouter sample_router() {
  return AdminRouter({
      {http::verb::get, "/healthz", "liveness",
       [](const HttpRequest& r) { return make_json_response(http::status::ok, R"({"status":"ok"})", r); }},
      {http::verb::put, "/admin/routes/*", "change a route",
       [](const HttpRequest& r) { return make_json_response(http::status::ok, std::string(r.target()), r); }},
  });
}

HttpRequest request(http::verb method, const char* target) {
  HttpRequest req{method, target, 11};
  req.keep_alive(true);
  return req;
}

}  // namespace

TEST_CASE("router dispatches exact and prefix paths, ignoring the query", "[proxy][admin]") {
  const auto router = sample_router();
  CHECK(router.handle(request(http::verb::get, "/healthz?verbose=1")).result() == http::status::ok);
  const auto routed = router.handle(request(http::verb::put, "/admin/routes/r1"));
  CHECK(routed.result() == http::status::ok);
  CHECK(routed.body() == "/admin/routes/r1");
  CHECK(router.handle(request(http::verb::put, "/admin/routes/")).result() == http::status::not_found);
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
  REQUIRE(listing["endpoints"].size() == 2);
  CHECK(listing["endpoints"][1]["path"] == "/admin/routes/*");
  CHECK(listing["endpoints"][1]["method"] == "PUT");
  CHECK(listing["endpoints"][1]["help"] == "change a route");
}

TEST_CASE("a path that is not UTF-8 gets a JSON 404, not an exception (found by fuzz_http_request)", "[proxy][admin]") {
  const auto router = sample_router();
  const auto missing = router.handle(request(http::verb::put, "/\xff\xffmin/routes/r1"));
  CHECK(missing.result() == http::status::not_found);
  const auto body = nlohmann::json::parse(missing.body());  // valid JSON: the bad bytes are replaced
  CHECK(body["error"]["message"] == "no endpoint at /\xEF\xBF\xBD\xEF\xBF\xBDmin/routes/r1");
}
