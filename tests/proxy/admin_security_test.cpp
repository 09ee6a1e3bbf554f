// The admin API's credential, on real daemons (docs/security.md): a mutating request needs
// the policy's bearer token (401 without it or with a wrong one, 403 when none is configured),
// changes nothing when refused, and every change is logged under the token's label, never the
// token. A token file that is missing, empty or unreadable fails the policy load with its pointer.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "kvrelay/shm_transport/client.h"

#include "support/daemon_fixture.h"

using namespace kvrelay;
using namespace kvrelay::test;
using nlohmann::json;

namespace {

json policy_with_route() {
  auto policy = basic_daemon_policy();
  const json model = {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
                      {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "w"}};
  policy["agents"] = {{{"id", "a"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}},
                      {{"id", "b"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}}};
  policy["routes"] = {{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}}};
  return policy;
}

json route(const DaemonUnderTest& daemon) {
  const auto reply = http_request(daemon.admin_port(), "GET", "/admin/routes");
  REQUIRE(reply.status == 200);
  return json::parse(reply.body)["routes"].at(0);
}

// One KV entry in the daemon's store, published over its data plane as a worker would.
void publish_entry(const std::string& socket_path) {
  auto client = shm::ShmClient::connect(socket_path);
  REQUIRE(client.has_value());
  const std::vector<std::byte> bytes(4096, std::byte{7});
  REQUIRE(client.value().publish({1, 2}, KvLayout{}, bytes).has_value());
}

bool entry_held(const std::string& socket_path) {
  auto client = shm::ShmClient::connect(socket_path);
  REQUIRE(client.has_value());
  return client.value().lookup({1, 2}).has_value();
}

struct Mutation {
  std::string method;
  std::string target;
  std::string body;
};
const std::vector<Mutation>& mutations() {
  static const std::vector<Mutation> all{{"PUT", "/admin/routes/a-to-b", R"({"enabled": false})"},
                                         {"POST", "/admin/reload", ""},
                                         {"DELETE", "/admin/kv", ""}};
  return all;
}

}  // namespace

TEST_CASE("a mutating admin request without the token or with a wrong one is a 401 and changes nothing",
          "[proxy][admin][security][process]") {
  TempDir sockets;
  const std::string socket_path = (sockets / "kvrelay.sock").string();
  auto policy = policy_with_route();
  policy["listen"]["unix_socket"] = socket_path;
  DaemonUnderTest daemon(policy);
  publish_entry(socket_path);
  // What a refused reload would apply.
  auto edited = policy;
  edited["routes"][0]["priority"] = 6;
  daemon.write_policy(edited);

  const std::vector<std::map<std::string, std::string>> credentials{
      {},
      admin_token_headers("wrong-token-but-long-enough"),
      admin_token_headers(std::string(kTestAdminToken) + "0"),
      {{"Authorization", std::string("Basic ") + kTestAdminToken}},
      {{"X-Admin-Token", kTestAdminToken}}};
  for (const auto& headers : credentials) {
    for (const auto& call : mutations()) {
      INFO(call.method << " " << call.target << " with " << (headers.empty() ? "no header" : headers.begin()->second));
      const auto reply = http_request(daemon.admin_port(), call.method, call.target, call.body, headers);
      CHECK(reply.status == 401);
      const auto challenge = reply.headers.find("www-authenticate");
      REQUIRE(challenge != reply.headers.end());
      CHECK_THAT(challenge->second, Catch::StartsWith("Bearer"));
      const auto body = json::parse(reply.body, nullptr, false);
      REQUIRE(body.is_object());
      CHECK(body["error"]["code"] == 401);
      CHECK(reply.body.find(kTestAdminToken) == std::string::npos);
    }
  }
  // Nothing changed: the route is as it was, the reload did not happen, the entry is still held.
  CHECK(route(daemon)["enabled"] == true);
  CHECK(route(daemon)["priority"] == 0);
  CHECK(entry_held(socket_path));
  const auto metrics = http_request(daemon.admin_port(), "GET", "/metrics").body;
  CHECK(metrics.find("kvrelay_config_reloads_total{result=\"ok\"} 1") == std::string::npos);

  // The right token makes each change, and the daemon still serves.
  const auto dropped = admin_request(daemon.admin_port(), "DELETE", "/admin/kv");
  REQUIRE(dropped.status == 200);
  CHECK(json::parse(dropped.body)["dropped_entries"] == 1);
  CHECK_FALSE(entry_held(socket_path));
  REQUIRE(admin_request(daemon.admin_port(), "POST", "/admin/reload").status == 200);
  CHECK(route(daemon)["priority"] == 6);
  REQUIRE(admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", R"({"enabled": false})").status == 200);
  CHECK(route(daemon)["enabled"] == false);
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("with no admin token configured the admin API is read-only: mutating endpoints answer 403",
          "[proxy][admin][security][process]") {
  auto policy = policy_with_route();
  policy["admin"] = json::object();  // an admin section that names no token
  DaemonUnderTest daemon(policy);
  for (const auto& call : mutations()) {
    INFO(call.method << " " << call.target);
    // Even a request that carries a token: there is none it could match.
    const auto reply = admin_request(daemon.admin_port(), call.method, call.target, call.body);
    CHECK(reply.status == 403);
    const auto body = json::parse(reply.body, nullptr, false);
    REQUIRE(body.is_object());
    CHECK(body["error"]["code"] == 403);
    CHECK_THAT(body["error"]["message"].get<std::string>(),
               Catch::Contains("read-only") && Catch::Contains("/admin/token_file"));
  }
  CHECK(route(daemon)["enabled"] == true);
  // Reads still answer, and the operator is told at start.
  CHECK(http_request(daemon.admin_port(), "GET", "/admin/decisions").status == 200);
  CHECK(wait_until([&] { return daemon.process().stderr_text().find("read-only") != std::string::npos; },
                   std::chrono::seconds(5)));
}

TEST_CASE("an admin change is logged with the token's label and what changed, never the token",
          "[proxy][admin][security][process]") {
  DaemonUnderTest daemon(policy_with_route());
  const auto changed =
      admin_request(daemon.admin_port(), "PUT", "/admin/routes/a-to-b", R"({"forced_medium": "kv_raw"})");
  REQUIRE(changed.status == 200);
  const std::string wrong = "a-wrong-token-that-must-not-be-logged";
  REQUIRE(http_request(daemon.admin_port(), "DELETE", "/admin/kv", "", admin_token_headers(wrong)).status == 401);
  REQUIRE(http_request(daemon.admin_port(), "POST", "/admin/reload").status == 401);

  // Every read endpoint's body, and a reload report, are free of the token too.
  std::vector<std::string> bodies;
  for (const char* path : {"/admin", "/admin/routes", "/admin/peers", "/admin/decisions", "/admin/codecs",
                           "/admin/upstreams", "/version", "/metrics"}) {
    const auto reply = http_request(daemon.admin_port(), "GET", path);
    CHECK(reply.status == 200);
    bodies.push_back(reply.body);
  }
  const auto reloaded = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  REQUIRE(reloaded.status == 200);
  bodies.push_back(reloaded.body);
  for (const auto& body : bodies)
    CHECK(body.find(kTestAdminToken) == std::string::npos);

  const std::string label = "admin-token sha256:";
  REQUIRE(wait_until(
      [&] {
        const auto log = daemon.process().stderr_text();
        return log.find("POST /admin/reload -> 200") != std::string::npos &&
               log.find("POST /admin/reload by no credential: 401") != std::string::npos;
      },
      std::chrono::seconds(5)));
  const auto log = daemon.process().stderr_text();
  INFO(log);
  CHECK_THAT(log, Catch::Contains("admin change by " + label));
  CHECK_THAT(log,
             Catch::Contains("PUT /admin/routes/a-to-b -> 200") && Catch::Contains("\"forced_medium\":\"kv_raw\""));
  CHECK_THAT(log, Catch::Contains("admin change refused: DELETE /admin/kv by a wrong bearer token: 401"));
  CHECK(log.find(kTestAdminToken) == std::string::npos);
  CHECK(log.find(wrong) == std::string::npos);
}

TEST_CASE("a reload re-reads the token file: the new token works, the old one is refused, a broken file keeps the old",
          "[proxy][admin][security][process]") {
  DaemonUnderTest daemon(policy_with_route());
  const auto token_file = daemon.dir() / "admin.token";
  const std::string rotated = "kvrelay-rotated-admin-token-77e1";
  write_file(token_file, rotated + "\n\n");  // trailing newlines are not part of the token
  const auto reloaded = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  REQUIRE(reloaded.status == 200);
  CHECK_THAT(reloaded.body, Catch::Contains("/admin/token_file"));
  CHECK(reloaded.body.find(rotated) == std::string::npos);
  CHECK(admin_request(daemon.admin_port(), "DELETE", "/admin/kv").status == 401);
  CHECK(http_request(daemon.admin_port(), "DELETE", "/admin/kv", "", admin_token_headers(rotated)).status == 200);

  write_file(token_file, "");  // empty: the reload is rejected and the rotated token still serves
  const auto rejected = http_request(daemon.admin_port(), "POST", "/admin/reload", "", admin_token_headers(rotated));
  CHECK(rejected.status == 422);
  CHECK_THAT(rejected.body, Catch::Contains("/admin/token_file: expected a token of at least 16 characters"));
  CHECK(http_request(daemon.admin_port(), "DELETE", "/admin/kv", "", admin_token_headers(rotated)).status == 200);
}

TEST_CASE("require_token_for_reads guards the read endpoints but not the health probes",
          "[proxy][admin][security][process]") {
  TempDir dir;
  write_file(dir / "token", std::string(kTestAdminToken));
  auto policy = policy_with_route();
  policy["admin"] = {{"token_file", (dir / "token").string()}, {"require_token_for_reads", true}};
  DaemonUnderTest daemon(policy);
  for (const char* path : {"/admin/routes", "/admin", "/metrics", "/admin/peers"}) {
    INFO(path);
    CHECK(http_request(daemon.admin_port(), "GET", path).status == 401);
    CHECK(admin_request(daemon.admin_port(), "GET", path).status == 200);
  }
  CHECK(http_request(daemon.admin_port(), "GET", "/healthz").status == 200);
  CHECK(http_request(daemon.admin_port(), "GET", "/readyz").status == 200);
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("a token file that is missing, empty or unreadable, or a token variable that is unset, fails the policy load",
          "[proxy][admin][security][process]") {
  TempDir dir;
  auto policy = policy_with_route();
  const auto check = [&](const json& admin, const std::string& expected) {
    INFO(admin.dump());
    policy["admin"] = admin;
    write_file(dir / "policy.json", policy.dump());
    const auto serve =
        run_command({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string()}, dir.path());
    CHECK(serve.exit_status == 2);
    CHECK_THAT(serve.err, Catch::Contains((dir / "policy.json").string() + ": " + expected));
    const auto checked =
        run_command({kvrelay_binary().string(), "check-config", (dir / "policy.json").string()}, dir.path());
    CHECK(checked.exit_status == 1);
    CHECK_THAT(checked.err, Catch::Contains(expected));
    // --skip-secrets checks the shape only (CI, before the secrets exist).
    const auto shape = run_command(
        {kvrelay_binary().string(), "check-config", "--skip-secrets", (dir / "policy.json").string()}, dir.path());
    CHECK(shape.exit_status == 0);
  };
  check({{"token_file", (dir / "absent").string()}}, "/admin/token_file: cannot open");
  write_file(dir / "empty", "\n");
  check({{"token_file", (dir / "empty").string()}}, "/admin/token_file: expected a token of at least 16 characters");
  write_file(dir / "short", "short\n");
  check({{"token_file", (dir / "short").string()}}, "/admin/token_file: expected a token of at least 16 characters");
  check({{"token_file", dir.path().string()}}, "/admin/token_file: " + dir.path().string() + " is not a regular file");
  check({{"token_env", "KVRELAY_TEST_UNSET_ADMIN_TOKEN"}},
        "/admin/token_env: environment variable KVRELAY_TEST_UNSET_ADMIN_TOKEN is not set");
  write_file(dir / "spaced", "has a space in it, so not a token\n");
  check({{"token_file", (dir / "spaced").string()}}, "/admin/token_file: the token has a character outside");

  // Shapes the loader refuses before reading anything.
  policy["admin"] = {{"token_file", "/x"}, {"token_env", "X"}};
  write_file(dir / "both.json", policy.dump());
  policy["admin"] = {{"require_token_for_reads", true}};
  write_file(dir / "reads.json", policy.dump());
  const auto shapes = run_command({kvrelay_binary().string(), "check-config", "--skip-secrets",
                                   (dir / "both.json").string(), (dir / "reads.json").string()},
                                  dir.path());
  CHECK(shapes.exit_status == 1);
  CHECK_THAT(shapes.err, Catch::Contains("both.json: /admin/token_env: set either token_file or token_env, not both"));
  CHECK_THAT(shapes.err, Catch::Contains("reads.json: /admin/require_token_for_reads: needs a token"));
  // None of these messages quotes a token.
  CHECK(shapes.err.find(kTestAdminToken) == std::string::npos);
}

TEST_CASE("the admin token can come from an environment variable", "[proxy][admin][security][process]") {
  TempDir dir;
  auto policy = policy_with_route();
  policy["admin"] = {{"token_env", "KVRELAY_ADMIN_TOKEN"}};
  write_file(dir / "policy.json", policy.dump());
  ChildProcess daemon({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string(), "--ready-file",
                       (dir / "ready.json").string()},
                      dir.path(), {std::string("KVRELAY_ADMIN_TOKEN=") + kTestAdminToken});
  REQUIRE(wait_until([&] { return std::filesystem::exists(dir / "ready.json") || !daemon.running(); },
                     std::chrono::seconds(20)));
  INFO(daemon.stderr_text());
  REQUIRE(std::filesystem::exists(dir / "ready.json"));
  const auto port = json::parse(read_file(dir / "ready.json"))["admin"].get<std::uint16_t>();
  CHECK(http_request(port, "DELETE", "/admin/kv").status == 401);
  CHECK(admin_request(port, "DELETE", "/admin/kv").status == 200);
}
