// `kvrelay admin` (issue #30, docs/admin-cli.md): the real binary against real daemons, for every
// subcommand, with the exit codes that say what failed: 2 usage, 3 unreachable, 4 unauthorised,
// 5 refused with the daemon's message. The last case makes real decisions (a reference worker
// behind a sidecar) and follows them as they are made.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kvrelay/broker/decision_log.h"

#include "support/daemon_fixture.h"
#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json admin_cli_policy() {
  auto policy = basic_daemon_policy();
  const json model = {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
                      {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "w"}};
  // Upstreams and the peer point at closed ports: these cases exercise the admin API alone.
  policy["agents"] = {{{"id", "a"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}},
                      {{"id", "b"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}}};
  policy["routes"] = {{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}, {"allowed_media", {"tokens", "kv_raw"}}}};
  policy["peers"] = {{{"id", "node-far"}, {"address", "127.0.0.1:9"}}};
  return policy;
}

std::string admin_url(std::uint16_t port) {
  return "http://127.0.0.1:" + std::to_string(port);
}

// `kvrelay admin --admin URL [--token-file FILE] ARGS...` run to completion.
CommandResult admin_cli(const std::string& url, const std::string& token_file, const std::vector<std::string>& args,
                        const std::filesystem::path& log_dir) {
  std::vector<std::string> argv{kvrelay_binary().string(), "admin", "--admin", url};
  if (!token_file.empty()) argv.insert(argv.end(), {"--token-file", token_file});
  argv.insert(argv.end(), args.begin(), args.end());
  auto result = run_command(argv, log_dir);
  UNSCOPED_INFO("kvrelay admin exit " << result.exit_status << "\nstdout: " << result.out
                                      << "\nstderr: " << result.err);
  return result;
}

json route_of(std::uint16_t admin_port, const std::string& id) {
  const auto reply = http_request(admin_port, "GET", "/admin/routes");
  REQUIRE(reply.status == 200);
  const auto body = json::parse(reply.body);
  for (const auto& route : body["routes"])
    if (route["id"] == id) return route;
  FAIL("no route " << id << " in GET /admin/routes");
  return {};
}

// A loopback port nothing listens on: bound, then closed.
std::uint16_t closed_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  socklen_t length = sizeof(address);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// The sequence numbers of the decision lines in `text` ("#12 ..."), in order.
std::vector<std::uint64_t> line_seqs(const std::string& text) {
  std::vector<std::uint64_t> seqs;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > 1 && line[0] == '#') seqs.push_back(std::stoull(line.substr(1)));
  }
  return seqs;
}

}  // namespace

TEST_CASE("the decision log numbers each decision and pages after a cursor for kvrelay admin decisions --follow",
          "[proxy][admin][console][unit]") {
  using kvrelay::broker::DecisionLog;
  DecisionLog log(4);
  const auto seqs = [](const json& decisions) {
    std::vector<std::uint64_t> out;
    for (const auto& decision : decisions)
      out.push_back(decision["seq"].get<std::uint64_t>());
    return out;
  };
  CHECK(log.query({}).cursor == 0);
  for (int index = 1; index <= 6; ++index) {
    log.record({{"kind", "lookup"}, {"route", index % 2 == 1 ? "r1" : "r2"}, {"medium", "m" + std::to_string(index)}});
  }
  CHECK(log.last_seq() == 6);
  // The ring holds 3..6. Without since: newest first; the cursor is the newest.
  auto page = log.query({});
  CHECK(seqs(page.decisions) == std::vector<std::uint64_t>{6, 5, 4, 3});
  CHECK(page.cursor == 6);
  CHECK(seqs(log.recent(2)) == std::vector<std::uint64_t>{6, 5});
  // since: oldest first, with what the ring dropped unread.
  page = log.query({0, "", 50});
  CHECK(seqs(page.decisions) == std::vector<std::uint64_t>{3, 4, 5, 6});
  CHECK(page.missed == 2);
  page = log.query({4, "r1", 50});
  CHECK(seqs(page.decisions) == std::vector<std::uint64_t>{5});
  CHECK(page.cursor == 6);
  CHECK(page.missed == 0);
  // Cut short by the limit: the cursor resumes after the last one returned.
  page = log.query({2, "", 2});
  CHECK(seqs(page.decisions) == std::vector<std::uint64_t>{3, 4});
  CHECK(page.cursor == 4);
  page = log.query({page.cursor, "", 2});
  CHECK(seqs(page.decisions) == std::vector<std::uint64_t>{5, 6});
  CHECK(page.cursor == 6);
  // A cursor from before a restart is ahead of the log: nothing, and a cursor behind it.
  page = log.query({9, "", 50});
  CHECK(page.decisions.empty());
  CHECK(page.cursor == 6);

  // Each route's newest decision that named a medium outlives the ring.
  for (int index = 7; index <= 10; ++index)
    log.record({{"kind", "push"}, {"route", "r2"}, {"medium", "m" + std::to_string(index)}});
  log.record({{"kind", "schedule"}, {"route", "r1"}});  // no medium: not a choice
  const auto last = log.last_by_route();
  CHECK(last["r1"]["seq"] == 5);
  CHECK(last["r1"]["medium"] == "m5");
  CHECK(last["r1"]["kind"] == "lookup");
  CHECK(last["r2"]["seq"] == 10);
  CHECK(last["r2"]["kind"] == "push");
  CHECK(seqs(log.query({}).decisions) == std::vector<std::uint64_t>{11, 10, 9, 8});
}

TEST_CASE("kvrelay admin route toggles a route that GET /admin/routes and kvrelay admin routes then show",
          "[proxy][admin][console][process]") {
  DaemonUnderTest daemon(admin_cli_policy());
  const auto url = admin_url(daemon.admin_port());
  const auto token = (daemon.dir() / "admin.token").string();
  TempDir logs;

  const auto table = admin_cli(url, "", {"routes"}, logs.path());
  REQUIRE(table.exit_status == 0);
  CHECK_THAT(table.out, Catch::Contains("LAST MEDIUM") && Catch::Contains("RECENT TTFT"));
  CHECK(std::regex_search(table.out, std::regex(R"(\na-to-b +a +b +yes +- +- +0 +-\n)")));

  const auto changed =
      admin_cli(url, token, {"route", "a-to-b", "--disable", "--force-medium", "kv_raw", "--audit-fraction", "0.25"},
                logs.path());
  REQUIRE(changed.exit_status == 0);
  CHECK_THAT(changed.out, Catch::Contains("enabled no") && Catch::Contains("forced medium kv_raw") &&
                              Catch::Contains("audit fraction 0.25"));
  auto route = route_of(daemon.admin_port(), "a-to-b");
  CHECK(route["enabled"] == false);
  CHECK(route["forced_medium"] == "kv_raw");
  CHECK(route["audit_fraction"] == 0.25);

  const auto listed = admin_cli(url, "", {"routes", "--json"}, logs.path());
  REQUIRE(listed.exit_status == 0);
  const auto routes = json::parse(listed.out)["routes"];
  REQUIRE(routes.size() == 1);
  CHECK(routes[0]["enabled"] == false);
  CHECK(routes[0]["last_decision"].is_null());  // no decision made yet
  CHECK(routes[0]["recent_ttft"]["audited_samples"] == 0);
  CHECK(routes[0]["recent_ttft"]["audited_median_ms"].is_null());
  CHECK(std::regex_search(admin_cli(url, "", {"routes"}, logs.path()).out,
                          std::regex(R"(\na-to-b +a +b +no +kv_raw +- +0\.25 +-\n)")));

  // The common options may also follow the subcommand's name.
  REQUIRE(admin_cli(url, "", {"route", "a-to-b", "--enable", "--clear-force", "--token-file", token}, logs.path())
              .exit_status == 0);
  route = route_of(daemon.admin_port(), "a-to-b");
  CHECK(route["enabled"] == true);
  CHECK(route["forced_medium"].is_null());

  // --admin and the token file from the environment.
  ChildProcess from_environment({kvrelay_binary().string(), "admin", "route", "a-to-b", "--disable"}, logs.path(),
                                {"KVRELAY_ADMIN=" + url, "KVRELAY_ADMIN_TOKEN_FILE=" + token});
  REQUIRE(from_environment.wait_for_exit(std::chrono::seconds(30)) == 0);
  CHECK(route_of(daemon.admin_port(), "a-to-b")["enabled"] == false);
}

TEST_CASE("kvrelay admin exit codes: 4 for a bad token and 5 with the daemon's message for a bad route",
          "[proxy][admin][console][process]") {
  DaemonUnderTest daemon(admin_cli_policy());
  const auto url = admin_url(daemon.admin_port());
  const auto token = (daemon.dir() / "admin.token").string();
  TempDir logs;
  write_file(logs / "wrong.token", "not-the-admin-token-but-long-enough\n");

  const auto wrong = admin_cli(url, (logs / "wrong.token").string(), {"route", "a-to-b", "--disable"}, logs.path());
  CHECK(wrong.exit_status == 4);
  CHECK_THAT(wrong.err, Catch::Contains("401") && Catch::Contains("not the admin token"));
  const auto without = admin_cli(url, "", {"route", "a-to-b", "--disable"}, logs.path());
  CHECK(without.exit_status == 4);
  CHECK_THAT(without.err, Catch::Contains("needs the admin token") && Catch::Contains("--token-file"));
  const auto reload_without = admin_cli(url, "", {"reload"}, logs.path());
  CHECK(reload_without.exit_status == 4);
  CHECK(route_of(daemon.admin_port(), "a-to-b")["enabled"] == true);  // nothing changed

  const auto no_route = admin_cli(url, token, {"route", "no-such-route", "--enable"}, logs.path());
  CHECK(no_route.exit_status == 5);
  CHECK_THAT(no_route.err, Catch::Contains("404") && Catch::Contains("no route 'no-such-route'"));
  const auto bad_fraction = admin_cli(url, token, {"route", "a-to-b", "--audit-fraction", "2"}, logs.path());
  CHECK(bad_fraction.exit_status == 5);
  CHECK_THAT(bad_fraction.err, Catch::Contains("/audit_fraction: expected number 0..1, got 2"));
  // With --json the daemon's JSON error is on stdout too, for scripts.
  const auto bad_medium =
      admin_cli(url, token, {"--json", "route", "a-to-b", "--force-medium", "carrier_pigeon"}, logs.path());
  CHECK(bad_medium.exit_status == 5);
  CHECK_THAT(bad_medium.err, Catch::Contains("/forced_medium"));
  const auto error = json::parse(bad_medium.out, nullptr, false);
  REQUIRE(error.is_object());
  CHECK(error["error"]["code"] == 400);
  const auto bad_limit = admin_cli(url, "", {"kv", "--limit", "5000"}, logs.path());
  CHECK(bad_limit.exit_status == 2);  // checked here, before any request
  CHECK(route_of(daemon.admin_port(), "a-to-b")["forced_medium"].is_null());

  // A daemon whose reads need the token, too.
  auto guarded_policy = admin_cli_policy();
  write_file(logs / "guarded.token", std::string(kTestAdminToken) + "\n");
  guarded_policy["admin"] = {{"token_file", (logs / "guarded.token").string()}, {"require_token_for_reads", true}};
  DaemonUnderTest guarded(guarded_policy);
  CHECK(admin_cli(admin_url(guarded.admin_port()), "", {"peers"}, logs.path()).exit_status == 4);
  CHECK(admin_cli(admin_url(guarded.admin_port()), (logs / "guarded.token").string(), {"peers"}, logs.path())
            .exit_status == 0);
}

TEST_CASE("kvrelay admin exit codes: 3 for an unreachable admin API and 2 for usage errors",
          "[proxy][admin][console][process]") {
  TempDir logs;
  const auto unreachable = admin_cli(admin_url(closed_port()), "", {"routes"}, logs.path());
  CHECK(unreachable.exit_status == 3);
  CHECK_THAT(unreachable.err, Catch::Contains("cannot connect to the admin API at http://127.0.0.1:"));
  CHECK(admin_cli(admin_url(closed_port()), "", {"decisions", "--follow"}, logs.path()).exit_status == 3);

  // A listener that accepts and never answers: the timeout ends the wait.
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(silent >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(silent, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(silent, 4) == 0);
  socklen_t length = sizeof(address);
  REQUIRE(::getsockname(silent, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  const auto silent_result =
      admin_cli(admin_url(ntohs(address.sin_port)), "", {"--timeout", "0.2", "peers"}, logs.path());
  ::close(silent);
  CHECK(silent_result.exit_status == 3);
  CHECK_THAT(silent_result.err, Catch::Contains("no answer from the admin API"));

  const auto url = admin_url(closed_port());
  for (const std::vector<std::string>& usage :
       std::vector<std::vector<std::string>>{{},
                                             {"frobnicate"},
                                             {"route"},
                                             {"route", "a-to-b"},
                                             {"route", "a-to-b", "--enable", "--disable"},
                                             {"route", "a-to-b", "--force-medium", "kv_raw", "--clear-force"},
                                             {"route", "a-to-b", "--audit-fraction", "half"},
                                             {"decisions", "--limit", "0"},
                                             {"audit", "--format", "pdf"},
                                             {"audit", "--format", "svg", "--json"},
                                             {"routes", "--no-such-option"}}) {
    std::string joined;
    for (const auto& arg : usage)
      joined += arg + " ";
    INFO("kvrelay admin " << joined);
    CHECK(admin_cli(url, "", usage, logs.path()).exit_status == 2);
  }
  CHECK(admin_cli("ftp://127.0.0.1:1", "", {"routes"}, logs.path()).exit_status == 2);
  CHECK(admin_cli(url, (logs / "missing.token").string(), {"routes"}, logs.path()).exit_status == 2);
  const auto help = admin_cli(url, "", {"--help"}, logs.path());
  CHECK(help.exit_status == 0);
  CHECK_THAT(help.out, Catch::Contains("routes") && Catch::Contains("decisions") && Catch::Contains("audit"));
  const auto route_help = admin_cli(url, "", {"route", "--help"}, logs.path());
  CHECK(route_help.exit_status == 0);
  CHECK_THAT(route_help.out, Catch::Contains("--force-medium"));
}

TEST_CASE("kvrelay admin peers kv reload and audit show the daemon's state and refuse a bad policy",
          "[proxy][admin][console][process]") {
  auto policy = admin_cli_policy();
  DaemonUnderTest daemon(policy);
  const auto url = admin_url(daemon.admin_port());
  const auto token = (daemon.dir() / "admin.token").string();
  TempDir logs;

  const auto peers = admin_cli(url, "", {"peers"}, logs.path());
  REQUIRE(peers.exit_status == 0);
  CHECK_THAT(peers.out, Catch::Contains("node test-node") && Catch::Contains("TRANSPORT"));
  CHECK(std::regex_search(peers.out, std::regex(R"(\nnode-far +127\.0\.0\.1:9 +tcp +)")));
  const auto peers_json = json::parse(admin_cli(url, "", {"peers", "--json"}, logs.path()).out);
  CHECK(peers_json["peers"][0]["id"] == "node-far");

  const auto kv = admin_cli(url, "", {"kv"}, logs.path());
  REQUIRE(kv.exit_status == 0);
  CHECK_THAT(kv.out,
             Catch::Contains("store: 0 B used of") && Catch::Contains("0 entries") && Catch::Contains("no entries"));
  const auto kv_json = json::parse(admin_cli(url, "", {"kv", "--json", "--limit", "3"}, logs.path()).out);
  CHECK(kv_json["entries"] == 0);
  CHECK(kv_json["budget_bytes"].get<double>() > 0);

  // A reload that changes a route: the report names it as applied live.
  policy["routes"][0]["priority"] = 5;
  daemon.write_policy(policy);
  const auto reloaded = admin_cli(url, token, {"reload"}, logs.path());
  REQUIRE(reloaded.exit_status == 0);
  CHECK_THAT(reloaded.out, Catch::Contains("reload: applied") && Catch::Contains("live: /routes/0/priority") &&
                               Catch::Contains("engine: "));
  CHECK(route_of(daemon.admin_port(), "a-to-b")["priority"] == 5);
  // A bad policy is refused with its JSON pointer, and the old one keeps serving.
  auto bad = policy;
  bad["routes"][0]["priority"] = 99;
  daemon.write_policy(bad);
  const auto refused = admin_cli(url, token, {"reload"}, logs.path());
  CHECK(refused.exit_status == 5);
  CHECK_THAT(refused.err, Catch::Contains("422") && Catch::Contains("/routes/0/priority"));
  CHECK(route_of(daemon.admin_port(), "a-to-b")["priority"] == 5);

  // The audit report without trials, in each format.
  const auto audit_json = admin_cli(url, "", {"audit", "--format", "json"}, logs.path());
  REQUIRE(audit_json.exit_status == 0);
  CHECK(json::parse(audit_json.out)["trials"] == 0);
  CHECK(json::parse(admin_cli(url, "", {"audit", "--json"}, logs.path()).out)["trials"] == 0);
  const auto markdown = admin_cli(url, "", {"audit"}, logs.path());
  REQUIRE(markdown.exit_status == 0);
  CHECK_FALSE(markdown.out.empty());
  CHECK(json::parse(markdown.out, nullptr, false).is_discarded());  // markdown, not JSON
  const auto svg = admin_cli(url, "", {"audit", "--format", "svg"}, logs.path());
  REQUIRE(svg.exit_status == 0);
  CHECK_THAT(svg.out, Catch::Contains("<svg"));

  // No decision yet: an empty log, and a cursor of 0.
  CHECK(admin_cli(url, "", {"decisions"}, logs.path()).out.empty());
  const auto none = json::parse(admin_cli(url, "", {"decisions", "--json"}, logs.path()).out);
  CHECK(none["decisions"].empty());
  CHECK(none["cursor"] == 0);
}

TEST_CASE("kvrelay admin decisions --follow prints a handoff decided after it started",
          "[proxy][admin][console][kv_path][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir logs;
  write_file(logs / "admin.token", std::string(kTestAdminToken) + "\n");
  const auto token = (logs / "admin.token").string();
  Sidecar node{"node-1"};
  // One worker serves both agents: A publishes its context, B's lookup decides how to get it.
  RefworkerUnderTest worker({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  const auto agents = json::array({agent_json("writer", "", worker.port(), stories_model_json()),
                                   agent_json("reader", "", worker.port(), stories_model_json())});
  // Only T0 (tokens) when audited, so that the audit report has its baseline.
  const json route = {
      {"id", "writer-to-reader"},
      {"from", "writer"},
      {"to", "reader"},
      {"allowed_media", {"tokens", "kv_raw"}},
      {"audit", {{"fraction", 0}, {"treatments", {{{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}}}}}}};
  auto policy = sidecar_policy(node, agents, json::array({route}));
  policy["admin"] = {{"token_file", token}};
  node.start(policy);
  const auto url = admin_url(node.admin_port());
  REQUIRE(admin_cli(url, token, {"route", "writer-to-reader", "--force-medium", "kv_raw"}, logs.path()).exit_status ==
          0);

  const auto handoff = [&node](int seed) {
    const auto a_prompt = context_prompt(seed);
    const auto a = node.complete("writer", greedy(a_prompt, 8, true));
    (void)node.complete("reader", greedy(handoff_prompt(a_prompt, a), 4));
  };
  handoff(1);
  const auto first = node.decisions(1).at(0);
  REQUIRE(first["route"] == "writer-to-reader");
  const auto first_seq = first["seq"].get<std::uint64_t>();

  ChildProcess follow({kvrelay_binary().string(), "admin", "--admin", url, "decisions", "--follow", "--route",
                       "writer-to-reader", "--limit", "1", "--interval", "0.05"},
                      logs.path());
  // It prints the newest decision first; once it has, the next one is made after it started.
  REQUIRE(wait_until([&] { return !line_seqs(follow.stdout_text()).empty(); }, std::chrono::seconds(20)));
  CHECK(line_seqs(follow.stdout_text()) == std::vector<std::uint64_t>{first_seq});
  handoff(2);
  const auto second = node.decisions(1).at(0);
  const auto second_seq = second["seq"].get<std::uint64_t>();
  CHECK(second_seq > first_seq);
  REQUIRE(wait_until([&] { return line_seqs(follow.stdout_text()).size() >= 2; }, std::chrono::seconds(20)));
  const auto streamed = follow.stdout_text();
  CHECK(line_seqs(streamed) == std::vector<std::uint64_t>{first_seq, second_seq});
  CHECK_THAT(streamed, Catch::Contains("lookup route=writer-to-reader agent=reader medium=kv_raw(forced) "
                                       "outcome=hit_local"));
  CHECK(follow.running());

  // The log as the daemon serves it: seq per decision, a cursor, since= and route= filters.
  const auto page = json::parse(http_request(node.admin_port(), "GET", "/admin/decisions?limit=50").body);
  CHECK(page["cursor"] == page["decisions"][0]["seq"]);
  const auto after_first =
      json::parse(http_request(node.admin_port(), "GET",
                               "/admin/decisions?route=writer-to-reader&since=" + std::to_string(first_seq))
                      .body);
  REQUIRE(after_first["decisions"].size() == 1);
  CHECK(after_first["decisions"][0]["seq"] == second_seq);
  CHECK(after_first["missed"] == 0);
  const auto other_route =
      json::parse(http_request(node.admin_port(), "GET", "/admin/decisions?route=no-such-route").body);
  CHECK(other_route["decisions"].empty());

  const auto lines = admin_cli(url, "", {"decisions", "--route", "writer-to-reader", "--limit", "2"}, logs.path());
  REQUIRE(lines.exit_status == 0);
  CHECK(line_seqs(lines.out) == std::vector<std::uint64_t>{first_seq, second_seq});
  CHECK_THAT(lines.out, Catch::Contains("cost kv_raw "));

  // routes: the last medium chosen, and the recent TTFT once a request is audited.
  auto routes = json::parse(admin_cli(url, "", {"routes", "--json"}, logs.path()).out)["routes"];
  CHECK(routes[0]["last_decision"]["medium"] == "kv_raw");
  CHECK(routes[0]["last_decision"]["seq"] == second_seq);
  CHECK(std::regex_search(admin_cli(url, "", {"routes"}, logs.path()).out,
                          std::regex(R"(\nwriter-to-reader +writer +reader +yes +kv_raw +kv_raw \(forced\) +0 +-\n)")));
  REQUIRE(admin_cli(url, token, {"route", "writer-to-reader", "--audit-fraction", "1"}, logs.path()).exit_status == 0);
  handoff(3);
  // The front proxy files the outcome when its relay ends, which can be just after the reply.
  REQUIRE(wait_until(
      [&] {
        const auto listed = json::parse(admin_cli(url, "", {"routes", "--json"}, logs.path()).out);
        return listed["routes"][0]["recent_ttft"]["audited_samples"] == 1;
      },
      std::chrono::seconds(10)));
  routes = json::parse(admin_cli(url, "", {"routes", "--json"}, logs.path()).out)["routes"];
  CHECK(routes[0]["recent_ttft"]["audited_median_ms"].get<double>() > 0.0);
  CHECK(routes[0]["last_decision"]["source"] == "treatment");
  CHECK_THAT(admin_cli(url, "", {"routes"}, logs.path()).out, Catch::Contains(" ms (audited, n=1)"));
  const auto report = admin_cli(url, "", {"audit", "--json"}, logs.path());
  REQUIRE(report.exit_status == 0);
  CHECK(json::parse(report.out)["trials"] == 1);
  CHECK(admin_cli(url, "", {"audit"}, logs.path()).exit_status == 0);

  // The follower saw the audited lookup too, and is still following.
  REQUIRE(wait_until([&] { return line_seqs(follow.stdout_text()).size() >= 3; }, std::chrono::seconds(20)));
  CHECK_THAT(follow.stdout_text(), Catch::Contains("medium=tokens(treatment)"));
  CHECK(follow.running());
}
