#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "support/daemon_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json policy_with_routes() {
  auto policy = basic_daemon_policy();
  const json model = {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
                      {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "w"}};
  // Upstreams point at a closed port: these tests exercise the sidecar alone.
  policy["agents"] = {{{"id", "a"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"kv_connector", true}},
                      {{"id", "b"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}}};
  policy["routes"] = {{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}, {"allowed_media", {"tokens", "kv_raw"}}}};
  return policy;
}

double metric_value(const std::string& metrics, const std::string& sample) {
  const auto at = metrics.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::stod(metrics.substr(at + sample.size() + 2));
}

// Metrics of a relayed request are recorded when the relay finishes, which can be just after the
// client has its response; poll briefly instead of assuming an order.
bool metric_reaches(std::uint16_t port, const std::string& sample, double expected) {
  return wait_until([&] { return metric_value(http_request(port, "GET", "/metrics").body, sample) == expected; },
                    std::chrono::seconds(5));
}

}  // namespace

TEST_CASE("admin lists routes and changes one live", "[proxy][admin][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  const auto routes = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  REQUIRE(routes["routes"].size() == 1);
  CHECK(routes["routes"][0]["enabled"] == true);

  const auto updated = admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b",
                                     R"({"enabled": false, "forced_medium": "kv_raw", "audit_fraction": 0.5})");
  REQUIRE(updated.status == 200);
  CHECK(json::parse(updated.body)["forced_medium"] == "kv_raw");
  const auto after = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  CHECK(after["routes"][0]["enabled"] == false);
  CHECK(after["routes"][0]["audit_fraction"] == 0.5);

  // Turned back on, live, without a restart.
  CHECK(admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", R"({"enabled": true})").status == 200);
  CHECK(json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body)["routes"][0]["enabled"] == true);
}

TEST_CASE("admin rejects bad route changes with a message naming the problem", "[proxy][admin][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  const auto unknown = admin_request(daemon.admin_port(), "PUT", "/admin/routes/nope", R"({"enabled": false})");
  CHECK(unknown.status == 404);
  const auto bad_type = admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", R"({"enabled": "no"})");
  CHECK(bad_type.status == 400);
  CHECK_THAT(bad_type.body, Catch::Contains("/enabled: expected boolean"));
  const auto not_allowed =
      admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", R"({"forced_medium": "kv_int4"})");
  CHECK(not_allowed.status == 400);
  CHECK_THAT(not_allowed.body, Catch::Contains("not in the route's allowed_media"));
  CHECK(admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", "{oops").status == 400);
  // Nothing of the rejected changes was applied.
  const auto routes = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  CHECK(routes["routes"][0]["enabled"] == true);
  CHECK(routes["routes"][0]["forced_medium"].is_null());
}

TEST_CASE("reload applies a valid policy and rejects a bad one, which keeps the old serving",
          "[proxy][admin][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  auto next = policy_with_routes();
  next["routes"][0]["priority"] = 6;
  daemon.write_policy(next);
  const auto applied = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  REQUIRE(applied.status == 200);
  CHECK(json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body)["routes"][0]["priority"] == 6);

  auto bad = next;
  bad["routes"][0]["to"] = "ghost";
  daemon.write_policy(bad);
  const auto rejected = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  CHECK(rejected.status == 422);
  CHECK_THAT(rejected.body, Catch::Contains("/routes/0/to: expected an agent id from /agents, got \\\"ghost\\\""));
  const auto routes = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  CHECK(routes["routes"][0]["to"] == "b");
  CHECK(routes["routes"][0]["priority"] == 6);

  const auto metrics = http_request(daemon.admin_port(), "GET", "/metrics").body;
  CHECK(metric_value(metrics, "kvrelay_config_reloads_total{result=\"ok\"}") == 1);
  CHECK(metric_value(metrics, "kvrelay_config_reloads_total{result=\"rejected\"}") == 1);
  CHECK(metric_value(metrics, "kvrelay_config_last_reload_successful") == 0);
}

TEST_CASE("SIGHUP reloads the policy file", "[proxy][admin][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  auto next = policy_with_routes();
  next["routes"][0]["audit_fraction"] = 0.25;
  daemon.write_policy(next);
  daemon.process().send_signal(SIGHUP);
  const bool reloaded = wait_until(
      [&] {
        const auto body = http_request(daemon.admin_port(), "GET", "/admin/routes").body;
        return json::parse(body)["routes"][0]["audit_fraction"] == 0.25;
      },
      std::chrono::seconds(5));
  CHECK(reloaded);
  CHECK(daemon.process().running());
}

TEST_CASE("front proxy answers unknown agents, unknown endpoints, bad bodies and dead upstreams with JSON errors",
          "[proxy][front][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  const auto ghost = http_request(daemon.http_port(), "POST", "/agents/ghost/v1/completions", R"({"prompt": [1]})");
  CHECK(ghost.status == 404);
  CHECK(json::parse(ghost.body)["error"]["type"] == "unknown_agent");
  CHECK(http_request(daemon.http_port(), "POST", "/agents/a/v1/embeddings", "{}").status == 404);
  const auto malformed = http_request(daemon.http_port(), "POST", "/agents/a/v1/completions", "{not json");
  CHECK(malformed.status == 400);
  CHECK_THAT(malformed.body, Catch::Contains("not valid JSON"));
  const auto dead = http_request(daemon.http_port(), "POST", "/agents/b/v1/completions", R"({"prompt": [1]})");
  CHECK(dead.status == 502);
  CHECK(json::parse(dead.body)["error"]["type"] == "upstream_error");

  const auto port = daemon.admin_port();
  CHECK(
      metric_reaches(port, "kvrelay_proxy_requests_total{agent=\"b\",endpoint=\"/v1/completions\",status=\"502\"}", 1));
  CHECK(metric_reaches(port, "kvrelay_proxy_upstream_errors_total{agent=\"b\",kind=\"connect\"}", 1));
  CHECK(
      metric_reaches(port, "kvrelay_proxy_requests_total{agent=\"a\",endpoint=\"/v1/completions\",status=\"400\"}", 1));
}

TEST_CASE("GET /admin lists the endpoint table", "[proxy][admin][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  const auto listing = json::parse(http_request(daemon.admin_port(), "GET", "/admin").body);
  std::set<std::string> paths;
  for (const auto& endpoint : listing["endpoints"])
    paths.insert(endpoint["path"].get<std::string>());
  for (const char* expected :
       {"/healthz", "/readyz", "/metrics", "/admin/routes", "/admin/routes/*", "/admin/reload"}) {
    CHECK(paths.count(expected) == 1);
  }
}

TEST_CASE("/admin/codecs lists built-in and plugin codecs and the plugins refused", "[proxy][admin][process]") {
  auto policy = policy_with_routes();
  const auto plugins = binary_dir() / "tests" / "codec_plugins" / "plugins";
  policy["codecs"]["plugin_dirs"] = {(plugins / "good").string(), (plugins / "bad").string()};
  DaemonUnderTest daemon(policy);
  const auto listing = json::parse(http_request(daemon.admin_port(), "GET", "/admin/codecs").body);
  std::map<std::string, json> codecs;
  for (const auto& codec : listing["codecs"])
    codecs[codec["name"].get<std::string>()] = codec;
  for (const char* builtin : {"raw", "lossless", "fp8", "int8", "int4", "sparse"}) {
    INFO(builtin);
    REQUIRE(codecs.count(builtin) == 1);
    CHECK(codecs[builtin]["origin"] == "built-in");
  }
  CHECK(codecs["lossless"]["lossless"] == true);
  CHECK(codecs["int4"]["lossless"] == false);
  REQUIRE(codecs.count("xor") == 1);
  CHECK_THAT(codecs["xor"]["origin"].get<std::string>(), Catch::EndsWith(".so"));
  // The bad directory holds a wrong ABI version, a wrong struct size, a missing entry symbol and a
  // plugin claiming a built-in id:
  // each is refused with its reason and the daemon serves on.
  REQUIRE(listing["refused_plugins"].size() == 4);
  CHECK_THAT(listing["refused_plugins"].dump(), Catch::Contains("version") && Catch::Contains("size"));
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("codecs.device places the GPU codecs at start, or refuses to start without the GPU it names",
          "[proxy][admin][process]") {
  // "auto" runs everywhere: fp8, int8 and int4 go to the GPU when this host has one.
  auto policy = policy_with_routes();
  policy["codecs"]["device"] = "auto";
  std::string quantizer_device;
  {
    DaemonUnderTest daemon(policy);
    const auto listing = json::parse(http_request(daemon.admin_port(), "GET", "/admin/codecs").body);
    std::map<std::string, std::string> devices;
    for (const auto& codec : listing["codecs"])
      devices[codec["name"].get<std::string>()] = codec["device"].get<std::string>();
    quantizer_device = devices["int8"];
    CHECK((quantizer_device == "cpu" || quantizer_device == "cuda"));
    CHECK(devices["fp8"] == quantizer_device);
    CHECK(devices["int4"] == quantizer_device);
    for (const char* host_only : {"raw", "lossless", "sparse"}) {
      INFO(host_only);
      CHECK(devices[host_only] == "cpu");
    }
    // The placement is made at start: a reload says so instead of claiming it applied.
    auto moved = policy;
    moved["codecs"]["device"] = "cpu";
    daemon.write_policy(moved);
    const auto reloaded = admin_request(daemon.admin_port(), "POST", "/admin/reload");
    REQUIRE(reloaded.status == 200);
    CHECK(json::parse(reloaded.body)["restart_required"] == json::array({"/codecs/device"}));
  }
  TempDir dir;
  policy["codecs"]["device"] = "cuda";
  write_file(dir / "cuda.json", policy.dump());
  if (quantizer_device == "cpu") {
    // Asked for a GPU it cannot have: a configuration error naming the setting and the reason.
    const auto result =
        run_command({kvrelay_binary().string(), "serve", "--config", (dir / "cuda.json").string()}, dir.path());
    CHECK(result.exit_status == 2);
    CHECK_THAT(result.err, Catch::Contains("/codecs/device") && Catch::Contains("cuda"));
  } else {
    DaemonUnderTest daemon(policy);
    CHECK(http_request(daemon.admin_port(), "GET", "/admin/codecs").body.find("\"cuda\"") != std::string::npos);
  }
  policy["codecs"]["device"] = "tpu";
  write_file(dir / "tpu.json", policy.dump());
  const auto bad =
      run_command({kvrelay_binary().string(), "serve", "--config", (dir / "tpu.json").string()}, dir.path());
  CHECK(bad.exit_status == 2);
  CHECK_THAT(bad.err, Catch::Contains("/codecs/device: expected \"cpu\", \"cuda\" or \"auto\""));
}

namespace {

// Every admin endpoint, with a request each accepts: 200 on the admin listener. The reload comes
// before the route change, so that the change is still there to see afterwards.
struct AdminCall {
  std::string method;
  std::string target;
  std::string body;
};
const std::vector<AdminCall>& admin_calls() {
  static const std::vector<AdminCall> calls{{"GET", "/admin", ""},
                                            {"GET", "/admin/routes", ""},
                                            {"POST", "/admin/reload", ""},
                                            {"PUT", "/admin/routes/a-to-b", R"({"enabled": false})"},
                                            {"DELETE", "/admin/kv", ""},
                                            {"GET", "/admin/decisions?limit=1", ""},
                                            {"GET", "/admin/codecs", ""},
                                            {"GET", "/admin/upstreams", ""},
                                            {"GET", "/admin/peers", ""},
                                            {"GET", "/admin/audit/report", ""},
                                            {"GET", "/admin/audit/calibration", ""},
                                            {"GET", "/version", ""}};
  return calls;
}

// Asserts that the agent listener refuses every admin call with a JSON 404 whose message has `hint`.
void check_agent_listener_refuses_admin(std::uint16_t agent_port, const std::string& hint) {
  for (const auto& call : admin_calls()) {
    INFO(call.method << " " << call.target);
    const auto reply = http_request(agent_port, call.method, call.target, call.body);
    CHECK(reply.status == 404);
    const auto body = json::parse(reply.body, nullptr, false);
    const bool is_error = body.is_object() && body.contains("error") && body["error"].is_object();
    CHECK(is_error);
    if (!is_error) continue;
    CHECK(body["error"].value("type", "") == "not_found");
    CHECK_THAT(body["error"].value("message", ""), Catch::Contains(hint));
  }
}

}  // namespace

TEST_CASE("the admin API answers only on listen.admin: every admin path is a 404 on the agent listener",
          "[proxy][admin][listener][process]") {
  DaemonUnderTest daemon(policy_with_routes());
  REQUIRE(daemon.admin_port() != daemon.http_port());
  check_agent_listener_refuses_admin(daemon.http_port(), "the admin API is on the admin listener");
  // The PUT above changed nothing: the route is still enabled, as the admin listener shows.
  const auto routes = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  CHECK(routes["routes"][0]["enabled"] == true);
  // /metrics is not on the agent listener unless the policy asks for it.
  const auto metrics = http_request(daemon.http_port(), "GET", "/metrics");
  CHECK(metrics.status == 404);
  CHECK_THAT(metrics.body, Catch::Contains("listen.metrics_on_http"));
  // What the agent listener does serve: health and agents.
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
  CHECK(http_request(daemon.http_port(), "GET", "/readyz").status == 200);
  const auto ghost = http_request(daemon.http_port(), "POST", "/agents/ghost/v1/completions", R"({"prompt": [1]})");
  CHECK(json::parse(ghost.body)["error"]["type"] == "unknown_agent");

  for (const auto& call : admin_calls()) {
    INFO(call.method << " " << call.target);
    CHECK(admin_request(daemon.admin_port(), call.method, call.target, call.body).status == 200);
  }
  // The admin listener's PUT did take effect.
  const auto after = json::parse(http_request(daemon.admin_port(), "GET", "/admin/routes").body);
  CHECK(after["routes"][0]["enabled"] == false);
  CHECK(http_request(daemon.admin_port(), "GET", "/metrics").status == 200);
}

TEST_CASE("a policy without listen.admin has no admin API on any listener", "[proxy][admin][listener][process]") {
  auto policy = policy_with_routes();
  policy["listen"].erase("admin");
  DaemonUnderTest daemon(policy);
  CHECK_FALSE(daemon.has_admin_listener());  // the ready file names no admin port
  check_agent_listener_refuses_admin(daemon.http_port(), "this policy has no listen.admin, so there is no admin API");
  CHECK(http_request(daemon.http_port(), "GET", "/metrics").status == 404);
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
  // The operator is told at start-up, not only by 404s.
  CHECK(wait_until([&] { return daemon.process().stderr_text().find("no admin API") != std::string::npos; },
                   std::chrono::seconds(5)));
}

TEST_CASE("listen.metrics_on_http serves /metrics on the agent listener, live across a reload",
          "[proxy][admin][listener][metrics][process]") {
  auto policy = policy_with_routes();
  policy["listen"]["metrics_on_http"] = true;
  DaemonUnderTest daemon(policy);
  const auto on_agent = http_request(daemon.http_port(), "GET", "/metrics");
  REQUIRE(on_agent.status == 200);
  CHECK_THAT(on_agent.body, Catch::Contains("kvrelay_config_last_reload_successful"));
  CHECK(http_request(daemon.admin_port(), "GET", "/metrics").status == 200);
  // Still not the admin API.
  CHECK(http_request(daemon.http_port(), "GET", "/admin/routes").status == 404);

  policy["listen"]["metrics_on_http"] = false;
  daemon.write_policy(policy);
  REQUIRE(admin_request(daemon.admin_port(), "POST", "/admin/reload").status == 200);
  CHECK(http_request(daemon.http_port(), "GET", "/metrics").status == 404);
  CHECK(http_request(daemon.admin_port(), "GET", "/metrics").status == 200);
}
