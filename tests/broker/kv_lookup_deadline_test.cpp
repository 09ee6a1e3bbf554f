// limits.kv_lookup_timeout_ms bounds a whole lookup, end to end: reference workers behind real
// sidecars, B's sidecar fetching A's KV through a relay that stalls one stage of the exchange.
// Each stall is slow progress (every piece meets its own read in time, the exchange as a whole
// does not), so only a deadline over connect, hello, request and every read turns it into a miss.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>

#include "support/kv_path_fixture.h"
#include "support/skip.h"
#include "support/stalling_relay.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kDeadlineAnswerTokens = 8;
// The lookup's deadline, and the relay's step: each piece of a held-back frame comes well
// within a read's own timeout, even one as short as the deadline; all three come well past it.
constexpr int kLookupDeadlineMs = 400;
constexpr std::chrono::milliseconds kStallStep{250};

struct StallCase {
  StallingRelay::Stall stall;
  const char* stage;  // what B's fetch record names
};
constexpr StallCase kStalls[] = {{StallingRelay::Stall::kHello, "peer hello"},
                                 {StallingRelay::Stall::kFetchReply, "fetch reply"},
                                 {StallingRelay::Stall::kTransfer, "fetch transfer"}};

// A data-plane socket whose connects complete in the kernel's backlog and are never answered.
class SilentDataPlane {
 public:
  explicit SilentDataPlane(std::string path) : path_(std::move(path)) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof(address.sun_path) - 1);
    fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(fd_, 16) != 0) {
      throw std::runtime_error("silent data plane: cannot listen on " + path_);
    }
  }
  ~SilentDataPlane() { ::close(fd_); }
  SilentDataPlane(const SilentDataPlane&) = delete;
  SilentDataPlane& operator=(const SilentDataPlane&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Writer A behind node A, reader B behind node B (whose lookups reach A through `relay`), and
// a reference worker without a sidecar.
struct StalledPair {
  explicit StalledPair(const std::filesystem::path& model)
      : worker_a({"--model", model.string()}, {"--kvrelay-socket", node_a.socket_path()}),
        worker_b({"--model", model.string()}, {"--kvrelay-socket", node_b.socket_path()}),
        reference({"--model", model.string()}) {}
  // A at once; B once `relay` (in front of A's peer port) exists.
  void start_a() {
    node_a.start(sidecar_policy(node_a,
                                json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                                             agent_json("reader", "node-b", 1, stories_model_json())}),
                                routes(), json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}}})));
  }
  void start_b(const StallingRelay& relay, bool same_host) {
    json peer{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(relay.port())}, {"same_host", same_host}};
    auto policy = sidecar_policy(node_b,
                                 json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                              agent_json("reader", "", worker_b.port(), stories_model_json())}),
                                 routes(), json::array({peer}));
    policy["limits"]["kv_lookup_timeout_ms"] = kLookupDeadlineMs;
    policy["limits"]["read_timeout_ms"] = 30'000;
    policy["limits"]["peer_summary_interval_ms"] = 0;  // only lookups talk to the relay
    node_b.start(policy);
  }
  static json routes() {
    return json::array(
        {{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}}});
  }
  // A answers, then B gets A's context; B's answer is checked against the tokens-only one when
  // it must have prefilled everything. Returns B's reply.
  json handoff(int seed, bool expect_miss) {
    const auto a_prompt = context_prompt(seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b_prompt = handoff_prompt(a_prompt, a);
    auto b = node_b.complete("reader", greedy(b_prompt, kDeadlineAnswerTokens));
    if (expect_miss) {
      // A miss: B's worker prefilled every token and answered as a tokens-only worker does.
      CHECK(b["kvrelay"]["cached_tokens"] == 0);
      CHECK(b["kvrelay"]["prefill_tokens"] == b_prompt.size());
      const auto reference_reply =
          http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, kDeadlineAnswerTokens).dump());
      REQUIRE(reference_reply.status == 200);
      CHECK(b["choices"][0]["token_ids"] == json::parse(reference_reply.body)["choices"][0]["token_ids"]);
    }
    return b;
  }
  // The one fetch attempt of B's last lookup, which must have missed: its result.
  std::string missed_fetch_result() {
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision.value("outcome", "") == "miss");
    CHECK(decision.value("served_tokens", -1) == 0);
    REQUIRE(decision.contains("fetch"));
    REQUIRE(decision["fetch"].size() == 1);
    return decision["fetch"][0].value("result", "");
  }

  Sidecar node_a{"node-a"};
  Sidecar node_b{"node-b"};
  RefworkerUnderTest worker_a;
  RefworkerUnderTest worker_b;
  RefworkerUnderTest reference;
};

}  // namespace

TEST_CASE("a lookup's deadline ends a fetch stalled at the hello, the reply or mid-transfer: B misses and prefills",
          "[proxy][kv_path][e2e][process][deadline][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  StalledPair pair(*model);
  pair.start_a();
  StallingRelay relay(pair.node_a.peer_port(), kStallStep);
  pair.start_b(relay, false);

  int seed = 300;
  for (const auto& [stall, stage] : kStalls) {
    INFO("stalled at " << stage);
    relay.stall(stall);
    pair.handoff(++seed, true);
    const auto result = pair.missed_fetch_result();
    INFO(result);
    CHECK(result.find("timeout") == 0);
    CHECK(result.find(stage) != std::string::npos);
    CHECK(result.find("deadline exceeded") != std::string::npos);
  }
  CHECK(pair.node_b.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"hit_peer\""}) == 0);

  // Nothing stalls now: the next lookup gets A's KV on a fresh connection, as every stalled
  // one was left mid-frame and dropped rather than reused.
  CHECK(pair.handoff(++seed, false)["kvrelay"]["cached_tokens"] == 208);
  CHECK(pair.node_b.decisions(1).at(0).value("kv_from", "") == "peer:node-a");
  CHECK(relay.connections() == 4);
}

TEST_CASE("a lookup's deadline ends a same-host fetch whose peer data plane never answers: B misses and prefills",
          "[proxy][kv_path][e2e][process][deadline][shm][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  StalledPair pair(*model);
  pair.start_a();
  // A's hello reaches B naming a data-plane socket that accepts and never answers.
  TempDir dir;
  SilentDataPlane silent((dir / "silent.sock").string());
  StallingRelay relay(pair.node_a.peer_port(), kStallStep);
  relay.offer_shared_memory(silent.path());
  pair.start_b(relay, true);

  pair.handoff(400, true);
  const auto result = pair.missed_fetch_result();
  INFO(result);
  CHECK(result.find("timeout") == 0);
  CHECK(result.find("shm connect") != std::string::npos);
  CHECK(result.find("deadline exceeded") != std::string::npos);
}

// Not a deadline, but the same relay: a peer that does not announce that it records fidelity
// (an older sidecar, which files KV computed over lossy imports as exact) is asked for no exact KV.
TEST_CASE("a peer without the fidelity capability serves no lossless lookup, lossy ones still fetch",
          "[proxy][kv_path][e2e][process][fidelity][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  StalledPair pair(*model);
  pair.start_a();
  StallingRelay relay(pair.node_a.peer_port(), kStallStep);
  relay.strip_capabilities(kvrelay::peer::kCapFidelity);
  pair.start_b(relay, false);

  pair.handoff(401, true);  // kv_raw: a miss, B prefills and answers as the tokens run does
  CHECK(pair.missed_fetch_result() == "holds none");
  pair.node_b.force_medium("writer-to-reader", "kv_int8");
  CHECK(pair.handoff(402, false)["kvrelay"]["cached_tokens"] == 208);
  CHECK(pair.node_b.decisions(1).at(0).value("kv_from", "") == "peer:node-a");
  CHECK(relay.connections() >= 1);
}
