// Same-host peers are authenticated by SO_PEERCRED against the policy (docs/security.md):
// node-b's sidecar runs as another uid (nobody) and fetches node-a's KV over node-a's data
// plane. While node-a's policy names another uid for node-b, node-a refuses the connection
// before reading a frame, and node-b's lookup falls back to TCP with node-a still serving; once
// the policy names node-b's real uid, the same fetch goes over shared memory. A connection
// identified as a same-host peer may only look entries up, and only entries of the models its
// agents use (as a TCP peer's fetch): a publish from it is refused.
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "kvrelay/shm_transport/client.h"

#include "refworker/skip.h"
#include "support/kv_path_fixture.h"

using namespace kvrelay;
using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::uint32_t kNobody = 65534;
constexpr std::uint32_t kSomeoneElse = 4242;  // the uid node-a's policy wrongly gives node-b
constexpr int kServedTokens = 208;            // A's 219 published tokens as 13 full blocks

// Publishes one entry to `socket` from a child process running as `uid` in group nogroup (which
// may open the socket file); its exit status is 0 on success, else the ErrorCode of the refusal.
int publish_as(std::uint32_t uid, const std::string& socket_path) {
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(uid) != 0) ::_exit(90);
    auto client = shm::ShmClient::connect(socket_path);
    if (!client) ::_exit(static_cast<int>(client.error().code));
    const std::vector<std::byte> bytes(4096, std::byte{1});
    const auto published = client.value().publish({9, 9}, KvLayout{}, bytes);
    ::_exit(published ? 0 : static_cast<int>(published.error().code));
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("a same-host peer whose uid is not the policy's is refused by SO_PEERCRED, and the sidecar still serves",
          "[proxy][kv_path][security][process][shm]") {
  if (::geteuid() != 0) KVRELAY_SKIP("not root: cannot run a peer sidecar under a uid of its own");
  if (!std::filesystem::exists("/usr/bin/setpriv")) KVRELAY_SKIP("no /usr/bin/setpriv (util-linux)");
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  const json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}});
  const auto a_policy = [&](std::uint32_t node_b_uid) {
    auto policy = sidecar_policy(
        node_a,
        json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                     agent_json("reader", "node-b", 1, stories_model_json())}),
        routes,
        json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}, {"same_host", true}, {"uid", node_b_uid}}}));
    // nobody may reach the socket file (0660, group nogroup): only SO_PEERCRED decides.
    policy["listen"]["unix_socket_group"] = "nogroup";
    return policy;
  };
  node_a.start(a_policy(kSomeoneElse));
  auto b_policy = sidecar_policy(
      node_b,
      json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                   agent_json("reader", "", worker_b.port(), stories_model_json())}),
      routes,
      json::array(
          {{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(node_a.peer_port())}, {"same_host", true}}}));
  b_policy["listen"]["allowed_uids"] = json::array({0});  // its worker runs as root
  node_b.start(b_policy, kNobody);
  node_b.force_medium("writer-to-reader", "kv_raw");

  int seed = 700;
  // One handoff; the last fetch attempt of B's decision record.
  const auto handoff = [&] {
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b = node_b.complete("reader", greedy(handoff_prompt(a_prompt, a), 8));
    CHECK(b["kvrelay"]["cached_tokens"] == kServedTokens);
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision.value("kv_from", "") == "peer:node-a");
    REQUIRE(decision.contains("fetch"));
    return decision["fetch"].back();
  };

  {  // node-a's policy says node-b runs as 4242: node-b's connection (uid 65534) is refused.
    const auto fetch = handoff();
    INFO(fetch.dump());
    CHECK(fetch.value("transport", "") == "tcp");
    CHECK_THAT(fetch.value("transport_note", ""),
               Catch::Contains("shared memory failed") && Catch::Contains("uid not allowed"));
    CHECK(wait_until(
        [&] {
          return node_a.process().stderr_text().find("shm: refused connection from uid 65534") != std::string::npos;
        },
        std::chrono::seconds(5)));
    // node-a still serves its own worker and its admin API.
    CHECK(node_a.complete("writer", greedy(context_prompt(1), 4))["choices"].size() == 1);
    CHECK(http_request(node_a.admin_port(), "GET", "/readyz").status == 200);
  }

  {  // With node-b's real uid in node-a's policy (a reload applies it) the same fetch is shared memory.
    node_a.reload(a_policy(kNobody));
    const auto fetch = handoff();
    INFO(fetch.dump());
    CHECK(fetch.value("transport", "") == "shm");
    CHECK(fetch.value("result", "") == "fetched");
  }

  {  // An authenticated same-host peer gets what its TCP fetch would: KV of the models its agents
     // use. With reader moved to node-c in node-a's policy, node-b has no agent there, so its
     // lookup over shared memory and its TCP fetch are both answered as misses, and B prefills.
    auto moved = a_policy(kNobody);
    moved["agents"][1]["node"] = "node-c";
    moved["peers"].push_back({{"id", "node-c"}, {"address", "127.0.0.1:2"}});
    node_a.reload(moved);
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b = node_b.complete("reader", greedy(handoff_prompt(a_prompt, a), 8));
    CHECK(b["kvrelay"]["cached_tokens"] == 0);
    const auto decision = node_b.decisions(1).at(0);
    INFO(decision.dump());
    CHECK(decision.dump().find("\"fetched\"") == std::string::npos);
    CHECK(wait_until(
        [&] {
          return node_a.process().stderr_text().find("same-host peer node-b: lookup of model") != std::string::npos;
        },
        std::chrono::seconds(5)));
    node_a.reload(a_policy(kNobody));
  }

  // A connection identified as same-host peer node-b may look up, never publish: a peer's KV
  // arrives as pushes over the peer plane. A uid that is neither a worker's nor a peer's is
  // refused at connect.
  CHECK(publish_as(kNobody, node_a.socket_path()) == static_cast<int>(ErrorCode::kPermissionDenied));
  CHECK(publish_as(65533, node_a.socket_path()) == static_cast<int>(ErrorCode::kPermissionDenied));
  CHECK(wait_until(
      [&] {
        return node_a.process().stderr_text().find("shm: refused connection from uid 65533") != std::string::npos;
      },
      std::chrono::seconds(5)));
  CHECK(node_a.complete("writer", greedy(context_prompt(2), 4))["choices"].size() == 1);
}
