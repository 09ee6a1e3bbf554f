// The fault suite on the path a real handoff takes: reference workers (stories260K) behind real
// `kvrelay serve` processes, sidecar B's KV path fetching A's KV over the peer plane (Fetch ->
// FetchReply + Chunk frames) and sidecar A pushing KV ahead to B (PushEncoded + Chunk frames,
// answered by Committed). The hostile party is a relay in this process between the two
// sidecars (support/stalling_relay.h), which knows nothing of the messages but the 12-byte frame
// header and the 20-byte chunk header: it kills a sidecar when a fraction of a transfer's chunk
// bytes has passed, flips single bits, cuts frames short, or falls silent.
//
// What must hold every time: B's lookup misses (within its deadline: a stage of the fetch that
// never completes can only end there) and B's worker prefills and answers exactly as a worker
// given only tokens does; nothing partial or corrupted is ever filed, in either sidecar's store
// (checked by key, through the peer plane's Summary, and by count, through DELETE /admin/kv and
// the kvrelay_shm_entries gauge); a sidecar that died comes back clean and the next handoff
// works. Counts only: no timing is asserted.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

#include "support/kv_path_fixture.h"
#include "support/skip.h"
#include "support/stalling_relay.h"

using namespace kvrelay::test;
using kvrelay::peer::PeerMessage;
using nlohmann::json;
using Direction = StallingRelay::Direction;

namespace {

constexpr int kFaultAnswerTokens = 8;
// B's lookup deadline. A fetch that detects the fault fails at once; one that cannot (a silent
// peer) ends here. B's own read timeout is far longer, so only the deadline ends those waits.
constexpr int kFaultLookupDeadlineMs = 1'500;
constexpr std::uint32_t kFaultBlockTokens = 16;

// Keys as comparable pairs.
using KeySet = std::set<std::pair<std::uint64_t, std::uint64_t>>;

std::uint64_t fault_model_id(std::uint16_t worker_port) {
  const auto models = http_request(worker_port, "GET", "/v1/models");
  REQUIRE(models.status == 200);
  return std::stoull(json::parse(models.body)["data"][0]["kvrelay"]["fingerprint_id"].get<std::string>(), nullptr, 16);
}

// The keys a sidecar's store holds, as its peer listener's Summary lists them.
KeySet fault_store_keys(const Sidecar& sidecar) {
  kvrelay::peer::PeerClientOptions options;
  options.node_id = "fault-test";
  auto client = kvrelay::peer::PeerClient::connect(kvrelay::HostPort{"127.0.0.1", sidecar.peer_port()}, options);
  REQUIRE(client.has_value());
  auto keys = client.value().summary();
  REQUIRE(keys.has_value());
  KeySet set;
  for (const auto& key : keys.value())
    set.emplace(key.model_id, key.context_hash);
  return set;
}

// The bytes of the exact entry a sidecar holds under `key` (empty: none), read through its data plane.
std::vector<std::byte> fault_entry_bytes(const Sidecar& sidecar, const std::pair<std::uint64_t, std::uint64_t>& key) {
  auto client = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
  REQUIRE(client.has_value());
  auto entry = client.value().lookup({key.first, key.second});
  if (!entry) return {};
  std::vector<std::byte> bytes(entry.value().info.bytes);
  REQUIRE(entry.value().read(0, bytes).has_value());
  return bytes;
}

// One gauge of a Prometheus page (its first sample); -1 if absent.
double fault_gauge(const std::string& page, const std::string& name) {
  std::istringstream lines(page);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) == 0 && line.size() > name.size() && (line[name.size()] == '{' || line[name.size()] == ' '))
      return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

double fault_entries(const Sidecar& sidecar) {
  return sidecar.metric_sum("kvrelay_shm_entries");
}

// DELETE /admin/kv: how many entries it dropped.
int fault_flush(const Sidecar& sidecar) {
  const auto reply = admin_request(sidecar.admin_port(), "DELETE", "/admin/kv");
  REQUIRE(reply.status == 200);
  return json::parse(reply.body)["dropped_entries"].get<int>();
}

// The latest lookup record of a sidecar's decision log.
json fault_last_lookup(const Sidecar& sidecar) {
  for (const auto& record : sidecar.decisions(8)) {
    if (record.value("kind", "") == "lookup") return record;
  }
  return json();
}

// The first word of a fetch attempt's result ("io", "checksum_mismatch", "timeout", ...).
std::string fault_result_kind(const std::string& result) {
  return result.substr(0, result.find(':'));
}

// One handoff's material: A's prompt and answer, B's prompt, the key A's KV is filed under and
// B's answer from a worker given tokens only.
struct FaultContext {
  json a_prompt;
  json a_reply;
  json b_prompt;
  std::pair<std::uint64_t, std::uint64_t> a_key;
  json reference_tokens;
};

// Writer A behind node A, reader B behind node B, a worker without a sidecar for tokens-only
// answers. B's fetches reach A through `to_a`, A's pushes reach B through `to_b`.
struct FaultPair {
  explicit FaultPair(const std::filesystem::path& model, bool push_route)
      : push(push_route),
        worker_a({"--model", model.string()}, {"--kvrelay-socket", node_a.socket_path()}),
        worker_b({"--model", model.string()}, {"--kvrelay-socket", node_b.socket_path()}),
        reference({"--model", model.string()}),
        model_id(fault_model_id(worker_a.port())) {
    node_a.start(policy_a());
    node_b.start(policy_b());
    to_a.set_upstream(node_a.peer_port());
    to_b.set_upstream(node_b.peer_port());
  }

  json routes() const {
    json route{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}};
    if (push) route["push"] = true;
    return json::array({route});
  }
  json policy_a() const {
    auto policy = sidecar_policy(node_a,
                                 json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                                              agent_json("reader", "node-b", 1, stories_model_json())}),
                                 routes(), json::array({{{"id", "node-b"}, {"address", address(to_b)}}}));
    policy["limits"]["read_timeout_ms"] = 1'000;       // a push to a silent B fails after this
    policy["limits"]["peer_summary_interval_ms"] = 0;  // only pushes talk to the relay
    return policy;
  }
  json policy_b() const {
    auto policy = sidecar_policy(node_b,
                                 json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                              agent_json("reader", "", worker_b.port(), stories_model_json())}),
                                 routes(), json::array({{{"id", "node-a"}, {"address", address(to_a)}}}));
    policy["limits"]["kv_lookup_timeout_ms"] = kFaultLookupDeadlineMs;
    policy["limits"]["read_timeout_ms"] = 30'000;
    policy["limits"]["peer_summary_interval_ms"] = 0;  // only lookups talk to the relay
    return policy;
  }
  static std::string address(const StallingRelay& relay) { return "127.0.0.1:" + std::to_string(relay.port()); }

  // A sidecar that was killed starts again on the same policy, data-plane socket and relay;
  // its worker's data-plane connection broke with it, so a short request (under one block:
  // nothing published) lets the worker reconnect.
  // The worker first finishes what it was doing when its sidecar died, so that nothing it
  // publishes on the way out reaches the new one.
  void restart(Sidecar& node, const json& policy, StallingRelay& relay, RefworkerUnderTest& worker,
               const std::string& agent) {
    CHECK(node.process().wait_for_exit(std::chrono::seconds(10)).has_value());  // the kill took
    CHECK(wait_until(
        [&] {
          const auto metrics = http_request(worker.port(), "GET", "/metrics");
          return metrics.status == 200 && fault_gauge(metrics.body, "vllm:num_requests_running") == 0 &&
                 fault_gauge(metrics.body, "vllm:num_requests_waiting") == 0;
        },
        std::chrono::seconds(20)));
    std::filesystem::remove(std::filesystem::path(node.socket_path()).parent_path() / "ready.json");
    node.start(policy);
    relay.set_upstream(node.peer_port());
    const json warm_up = json::array({1, 5, 6, 7, 8});
    const auto reply = http_request(node.http_port(), "POST", "/agents/" + agent + "/v1/completions",
                                    greedy(warm_up, 1).dump(), {}, std::chrono::seconds(60));
    REQUIRE(reply.status == 200);
    CHECK(fault_store_keys(node).empty());  // it came back clean
  }
  void restart_a() { restart(node_a, policy_a(), to_a, worker_a, "writer"); }
  void restart_b() { restart(node_b, policy_b(), to_b, worker_b, "reader"); }

  // A answers a fresh context (and publishes its KV, 208 tokens in 13 blocks).
  FaultContext publish(int seed) {
    FaultContext context;
    context.a_prompt = context_prompt(seed);
    context.a_reply = node_a.complete("writer", greedy(context.a_prompt, 20, true));
    const auto published = context.a_reply["kvrelay"]["published_tokens"].get<std::size_t>();
    REQUIRE(published >= 200);
    context.b_prompt = handoff_prompt(context.a_prompt, context.a_reply);
    auto tokens = context.b_prompt.get<std::vector<kvrelay::TokenId>>();
    tokens.resize(published);
    const auto hashes = kvrelay::hash_blocks(model_id, tokens, kFaultBlockTokens);
    REQUIRE(hashes.size() == 13);
    context.a_key = {model_id, hashes.back()};
    const auto reference_reply =
        http_request(reference.port(), "POST", "/v1/completions", greedy(context.b_prompt, kFaultAnswerTokens).dump());
    REQUIRE(reference_reply.status == 200);
    context.reference_tokens = json::parse(reference_reply.body)["choices"][0]["token_ids"];
    return context;
  }
  // B's worker gets the handoff through B's front proxy.
  json handoff(const FaultContext& context) const {
    return node_b.complete("reader", greedy(context.b_prompt, kFaultAnswerTokens));
  }
  // B missed: its worker prefilled every token, answered as the tokens-only worker does, and
  // B's lookup record says so, with the fetch attempt's result (returned) not "fetched".
  std::string check_miss(const FaultContext& context, const json& b) const {
    CHECK(b["kvrelay"]["cached_tokens"] == 0);
    CHECK(b["kvrelay"]["prefill_tokens"] == context.b_prompt.size());
    CHECK(b["choices"][0]["token_ids"] == context.reference_tokens);
    const auto lookup = fault_last_lookup(node_b);
    CHECK(lookup.value("outcome", "") == "miss");
    CHECK(lookup.value("served_tokens", -1) == 0);
    if (!lookup.contains("fetch") || lookup["fetch"].empty()) return "(no fetch attempt)";
    const auto result = lookup["fetch"].back().value("result", "");
    CHECK(result != "fetched");
    return result;
  }
  // B hit with A's KV from `from` ("peer:node-a", "local"), and answered as the tokens run does.
  void check_hit(const FaultContext& context, const json& b, const std::string& from) const {
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    CHECK(b["choices"][0]["token_ids"] == context.reference_tokens);
    CHECK(fault_last_lookup(node_b).value("kv_from", "") == from);
  }
  double pushes(const std::string& result) const {
    return node_a.metric_sum("kvrelay_kv_pushes_total", {"result=\"" + result + "\""});
  }
  // Waits for A's pusher to count one more push with `result`.
  void wait_push(const std::string& result, double before) const {
    CHECK(wait_until([&] { return pushes(result) > before; }, std::chrono::seconds(20)));
  }

  bool push;
  StallingRelay to_a{0};
  StallingRelay to_b{0};
  Sidecar node_a{"node-a"};
  Sidecar node_b{"node-b"};
  RefworkerUnderTest worker_a;
  RefworkerUnderTest worker_b;
  RefworkerUnderTest reference;
  std::uint64_t model_id;
};

// Kills a sidecar (SIGKILL) and waits until it is gone. Run at a cut, on the relay's thread.
void fault_kill(Sidecar& node) {
  node.process().send_signal(SIGKILL);
}

// A latch the test thread opens once it may let a cut's action run.
class FaultGate {
 public:
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    wake_.notify_all();
  }
  bool wait() {
    std::unique_lock lock(mutex_);
    return wake_.wait_for(lock, std::chrono::seconds(20), [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool open_ = false;
};

constexpr std::uint64_t kKillPercents[] = {10, 50, 90};

}  // namespace

TEST_CASE("fault: a sidecar killed at 10, 50 and 90 percent of a fetch reply: B misses or restarts clean",
          "[kv_path][e2e][process][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, false);

  // A clean handoff: B fetches A's KV; the reply's chunk bytes are what the fractions are of.
  int seed = 500;
  const auto first = pair.publish(++seed);
  pair.check_hit(first, pair.handoff(first), "peer:node-a");
  const std::uint64_t reply_bytes = pair.to_a.chunk_body_bytes(Direction::kToClient);
  REQUIRE(reply_bytes > 200'000);        // 208 tokens of raw KV and the frame around them
  CHECK(fault_flush(pair.node_b) == 2);  // A's fetched entry and B's own publish

  for (const std::uint64_t percent : kKillPercents) {
    const std::uint64_t cut_at = reply_bytes * percent / 100;
    {
      INFO("serving sidecar A killed at " << percent << "% of the fetch reply");
      const auto context = pair.publish(++seed);
      const int applied = pair.to_a.faults_applied();
      pair.to_a.cut_after_chunk_bytes(Direction::kToClient, cut_at, [&] { fault_kill(pair.node_a); });
      const auto result = pair.check_miss(context, pair.handoff(context));
      INFO(result);
      CHECK(pair.to_a.faults_applied() == applied + 1);
      CHECK(fault_result_kind(result) == "io");  // the connection ended under the reply
      // B filed nothing of A's: its store holds its own publish only.
      const auto b_keys = fault_store_keys(pair.node_b);
      CHECK_FALSE(b_keys.contains(context.a_key));
      CHECK(b_keys.size() == 1);
      CHECK(fault_flush(pair.node_b) == 1);
      pair.restart_a();
      // A comes back empty; the next handoff works end to end again.
      const auto again = pair.publish(++seed);
      pair.check_hit(again, pair.handoff(again), "peer:node-a");
      CHECK(fault_flush(pair.node_b) == 2);
    }
    {
      INFO("fetching sidecar B killed at " << percent << "% of the fetch reply");
      const auto context = pair.publish(++seed);
      const KeySet a_before = fault_store_keys(pair.node_a);
      REQUIRE(a_before.contains(context.a_key));
      const int applied = pair.to_a.faults_applied();
      pair.to_a.cut_after_chunk_bytes(Direction::kToClient, cut_at, [&] { fault_kill(pair.node_b); });
      // B's agent gets an error answer: its sidecar died under the request.
      const auto reply =
          http_request(pair.node_b.http_port(), "POST", "/agents/reader/v1/completions",
                       greedy(context.b_prompt, kFaultAnswerTokens).dump(), {}, std::chrono::seconds(30));
      CHECK(reply.status != 200);
      CHECK(pair.to_a.faults_applied() == applied + 1);
      // A served a fetch: its store is what it was.
      CHECK(fault_store_keys(pair.node_a) == a_before);
      pair.restart_b();
      // B comes back empty and fetches the same KV again, whole.
      pair.check_hit(context, pair.handoff(context), "peer:node-a");
      const auto b_keys = fault_store_keys(pair.node_b);
      CHECK(b_keys.contains(context.a_key));
      CHECK(b_keys.size() == 2);
      CHECK(fault_flush(pair.node_b) == 2);
    }
  }
}

TEST_CASE("fault: a sidecar killed at 10, 50 and 90 percent of a push: nothing partial is filed",
          "[kv_path][e2e][process][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, true);

  // A clean push: B's lookup is then a local hit. The push's chunk bytes are what the fractions
  // are of.
  int seed = 600;
  double pushed = pair.pushes("pushed");
  const auto first = pair.publish(++seed);
  pair.wait_push("pushed", pushed);
  const std::uint64_t push_bytes = pair.to_b.chunk_body_bytes(Direction::kToSidecar);
  REQUIRE(push_bytes > 200'000);
  CHECK(fault_store_keys(pair.node_b).contains(first.a_key));
  pair.check_hit(first, pair.handoff(first), "local");
  CHECK(fault_flush(pair.node_b) == 2);

  for (const std::uint64_t percent : kKillPercents) {
    const std::uint64_t cut_at = push_bytes * percent / 100;
    {
      INFO("pushing sidecar A killed at " << percent << "% of the push");
      // A must answer its agent first: the kill waits for the test to let it go.
      FaultGate gate;
      const int applied = pair.to_b.faults_applied();
      pair.to_b.cut_after_chunk_bytes(Direction::kToSidecar, cut_at, [&] {
        if (gate.wait()) fault_kill(pair.node_a);
      });
      const auto context = pair.publish(++seed);
      gate.open();
      CHECK(wait_until([&] { return pair.to_b.faults_applied() == applied + 1; }, std::chrono::seconds(20)));
      CHECK(pair.node_a.process().wait_for_exit(std::chrono::seconds(10)).has_value());
      // B filed nothing of the push.
      CHECK(fault_store_keys(pair.node_b).empty());
      CHECK(fault_entries(pair.node_b) == 0);
      // B's lookup finds nothing here and A is gone: a miss, B prefills.
      const auto result = pair.check_miss(context, pair.handoff(context));
      INFO(result);
      const auto b_keys = fault_store_keys(pair.node_b);
      CHECK_FALSE(b_keys.contains(context.a_key));
      CHECK(b_keys.size() == 1);
      CHECK(fault_flush(pair.node_b) == 1);
      pair.restart_a();
      pushed = pair.pushes("pushed");
      const auto again = pair.publish(++seed);
      pair.wait_push("pushed", pushed);
      pair.check_hit(again, pair.handoff(again), "local");
      CHECK(fault_flush(pair.node_b) == 2);
    }
    {
      INFO("receiving sidecar B killed at " << percent << "% of the push");
      const int applied = pair.to_b.faults_applied();
      const double failed = pair.pushes("failed");
      pair.to_b.cut_after_chunk_bytes(Direction::kToSidecar, cut_at, [&] { fault_kill(pair.node_b); });
      const auto context = pair.publish(++seed);
      CHECK(wait_until([&] { return pair.to_b.faults_applied() == applied + 1; }, std::chrono::seconds(20)));
      pair.wait_push("failed", failed);  // A's pusher saw the push fail
      // A keeps its own KV and nothing else.
      const auto a_keys = fault_store_keys(pair.node_a);
      CHECK(a_keys.contains(context.a_key));
      pair.restart_b();
      CHECK(fault_entries(pair.node_b) == 0);
      // B fetches the KV the push did not deliver.
      pair.check_hit(context, pair.handoff(context), "peer:node-a");
      CHECK(fault_flush(pair.node_b) == 2);
    }
  }
}

TEST_CASE("fault: every single-bit flip of a fetch reply's frame and chunk headers, and 1,000 in its chunk body",
          "[kv_path][e2e][process][fault][flips]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, false);

  // One context for every flip: A publishes once, B's store is flushed after each handoff.
  // Every flip is a whole handoff through the real sidecars and workers: 1,712 of them took
  // 79-100 s on the 2-core development VM shared with other builds (about 50 ms each), so the
  // body flips need no shortcut through a bare fetch.
  const auto context = pair.publish(700);
  pair.check_hit(context, pair.handoff(context), "peer:node-a");
  const std::size_t reply_payload = pair.to_a.last_payload_length(Direction::kToClient, PeerMessage::kFetchReply);
  const std::size_t chunk_payload = pair.to_a.last_payload_length(Direction::kToClient, PeerMessage::kChunk);
  // One chunk today (a 266 KB frame, 1 MiB chunks); the chunk flips go to the reply's first.
  REQUIRE(pair.to_a.frames(Direction::kToClient, PeerMessage::kChunk) >= 1);
  REQUIRE(reply_payload > 0);
  REQUIRE(chunk_payload > kvrelay::peer::kChunkHeaderBytes);
  CHECK(fault_flush(pair.node_b) == 2);
  const KeySet a_keys = fault_store_keys(pair.node_a);

  struct Flip {
    PeerMessage frame;
    std::size_t byte;
    unsigned bit;
  };
  std::vector<Flip> flips;
  for (std::size_t byte = 0; byte < kvrelay::peer::kPeerHeaderBytes + reply_payload; ++byte)
    for (unsigned bit = 0; bit < 8; ++bit)
      flips.push_back({PeerMessage::kFetchReply, byte, bit});
  for (std::size_t byte = 0; byte < kvrelay::peer::kPeerHeaderBytes + kvrelay::peer::kChunkHeaderBytes; ++byte)
    for (unsigned bit = 0; bit < 8; ++bit)
      flips.push_back({PeerMessage::kChunk, byte, bit});
  const std::size_t header_flips = flips.size();
  std::mt19937_64 rng(24);
  const std::size_t body_first = kvrelay::peer::kPeerHeaderBytes + kvrelay::peer::kChunkHeaderBytes;
  const std::size_t body_bytes = chunk_payload - kvrelay::peer::kChunkHeaderBytes;
  for (int index = 0; index < 1'000; ++index)
    flips.push_back({PeerMessage::kChunk, body_first + rng() % body_bytes, static_cast<unsigned>(rng() % 8)});

  // Each flip: one handoff through the real sidecars (B flushed after it). The outcome must be
  // a miss with nothing of A's filed on B, or, where the flipped bit is one the transfer does
  // not depend on (chunk_bytes still naming a single chunk: the checksums then prove the KV
  // whole), a hit whose entry on B equals A's byte for byte. Counted; any other outcome is named.
  const auto a_bytes = fault_entry_bytes(pair.node_a, context.a_key);
  REQUIRE(!a_bytes.empty());
  std::map<std::string, int> results;
  int misses = 0;
  int exact_hits = 0;
  std::vector<std::string> hits;
  std::vector<std::string> failures;
  const auto started = std::chrono::steady_clock::now();
  for (std::size_t index = 0; index < flips.size(); ++index) {
    const auto& flip = flips[index];
    const std::string where = std::string(flip.frame == PeerMessage::kChunk ? "chunk" : "fetch reply") + " byte " +
                              std::to_string(flip.byte) + " bit " + std::to_string(flip.bit);
    const int applied = pair.to_a.faults_applied();
    // A chunk flip applies to the chunk of this handoff's reply, on its connection.
    pair.to_a.flip_bit(Direction::kToClient, flip.frame, flip.byte, flip.bit,
                       flip.frame == PeerMessage::kChunk ? std::optional(PeerMessage::kFetchReply) : std::nullopt);
    const auto b = pair.handoff(context);
    const bool flipped = pair.to_a.faults_applied() == applied + 1;
    const auto lookup = fault_last_lookup(pair.node_b);
    const std::string result =
        lookup.contains("fetch") && !lookup["fetch"].empty() ? lookup["fetch"].back().value("result", "") : "";
    ++results[fault_result_kind(result)];
    const bool as_tokens = b["choices"][0]["token_ids"] == context.reference_tokens;
    const bool miss = b["kvrelay"]["cached_tokens"] == 0 && lookup.value("outcome", "") == "miss";
    bool clean = false;
    if (miss) {
      // B holds exactly what its worker published: one entry, not A's key.
      clean = !fault_store_keys(pair.node_b).contains(context.a_key) && fault_flush(pair.node_b) == 1;
      misses += clean && as_tokens ? 1 : 0;
    } else {
      clean = b["kvrelay"]["cached_tokens"] == 208 && fault_entry_bytes(pair.node_b, context.a_key) == a_bytes &&
              fault_flush(pair.node_b) == 2;
      exact_hits += clean && as_tokens ? 1 : 0;
      hits.push_back(where);
    }
    if (!flipped || !clean || !as_tokens) {
      failures.push_back(where + ": flipped " + std::to_string(flipped) + ", outcome " + lookup.value("outcome", "") +
                         ", result '" + result + "', clean " + std::to_string(clean) + ", answer as tokens " +
                         std::to_string(as_tokens));
      fault_flush(pair.node_b);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::string summary;
  for (const auto& [kind, count] : results)
    summary += kind + ": " + std::to_string(count) + "; ";
  std::string hit_list;
  for (const auto& hit : hits)
    hit_list += hit + "; ";
  WARN(flips.size() << " flips (" << header_flips << " in headers) in " << seconds << " s; fetch results " << summary
                    << "hits (flip the transfer does not depend on): " << hit_list);
  for (std::size_t index = 0; index < std::min<std::size_t>(failures.size(), 20); ++index)
    UNSCOPED_INFO(failures[index]);
  CHECK(failures.empty());
  CHECK(misses + exact_hits == static_cast<int>(flips.size()));
  CHECK(results.count("") == 0);  // every flip reached B's fetch
  // Every chunk flip, body or header, is a miss; only fetch-reply bits may not matter.
  for (const auto& hit : hits)
    CHECK(hit.rfind("fetch reply", 0) == 0);
  // A's store never changed, and a clean handoff still fetches.
  CHECK(fault_store_keys(pair.node_a) == a_keys);
  pair.check_hit(context, pair.handoff(context), "peer:node-a");
}

TEST_CASE("fault: a silent peer and truncated frames on the fetch path: B misses within its deadline",
          "[kv_path][e2e][process][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, false);
  int seed = 800;

  // A peer that accepts and never answers: B's hello goes unanswered until the deadline.
  pair.to_a.silent_accepts(true);
  {
    const auto context = pair.publish(++seed);
    const auto result = pair.check_miss(context, pair.handoff(context));
    INFO(result);
    CHECK(result.find("timeout") == 0);
    CHECK(result.find("deadline exceeded") != std::string::npos);
    CHECK(fault_flush(pair.node_b) == 1);
  }
  pair.to_a.silent_accepts(false);
  const auto calibration = pair.publish(++seed);
  pair.check_hit(calibration, pair.handoff(calibration), "peer:node-a");
  CHECK(fault_flush(pair.node_b) == 2);
  const std::size_t reply_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_a.last_payload_length(Direction::kToClient, PeerMessage::kFetchReply);
  const std::size_t chunk_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_a.last_payload_length(Direction::kToClient, PeerMessage::kChunk);

  // A peer that stops answering on a connection that worked: before the reply, before the chunks.
  for (const auto type : {PeerMessage::kFetchReply, PeerMessage::kChunk}) {
    INFO("silent from frame type " << static_cast<int>(type));
    const auto context = pair.publish(++seed);
    const int applied = pair.to_a.faults_applied();
    pair.to_a.silence_from(Direction::kToClient, type);
    const auto result = pair.check_miss(context, pair.handoff(context));
    INFO(result);
    CHECK(pair.to_a.faults_applied() == applied + 1);
    CHECK(result.find("timeout") == 0);
    CHECK(result.find("deadline exceeded") != std::string::npos);
    CHECK(fault_flush(pair.node_b) == 1);
  }

  // The stream cut mid-frame and closed: in the reply's header and payload, in the chunk's frame
  // header, chunk header and body, one byte short of the end.
  struct Cut {
    PeerMessage frame;
    std::size_t keep;
  };
  const Cut cuts[] = {{PeerMessage::kFetchReply, 0},
                      {PeerMessage::kFetchReply, 5},
                      {PeerMessage::kFetchReply, 12},
                      {PeerMessage::kFetchReply, reply_frame - 1},
                      {PeerMessage::kChunk, 0},
                      {PeerMessage::kChunk, 7},
                      {PeerMessage::kChunk, 12 + 10},
                      {PeerMessage::kChunk, 12 + 20},
                      {PeerMessage::kChunk, chunk_frame / 2},
                      {PeerMessage::kChunk, chunk_frame - 1}};
  for (const auto& cut : cuts) {
    INFO("cut after " << cut.keep << " bytes of frame type " << static_cast<int>(cut.frame));
    const auto context = pair.publish(++seed);
    const int applied = pair.to_a.faults_applied();
    pair.to_a.cut_frame(Direction::kToClient, cut.frame, cut.keep,
                        cut.frame == PeerMessage::kChunk ? std::optional(PeerMessage::kFetchReply) : std::nullopt);
    const auto result = pair.check_miss(context, pair.handoff(context));
    INFO(result);
    CHECK(pair.to_a.faults_applied() == applied + 1);
    CHECK(fault_result_kind(result) == "io");  // seen as the connection ending, at once
    const auto b_keys = fault_store_keys(pair.node_b);
    CHECK_FALSE(b_keys.contains(context.a_key));
    CHECK(fault_flush(pair.node_b) == 1);
  }
  // And the next clean handoff fetches.
  const auto last = pair.publish(++seed);
  pair.check_hit(last, pair.handoff(last), "peer:node-a");
}

TEST_CASE("fault: a silent peer and truncated frames on the push path: nothing is filed, B fetches instead",
          "[kv_path][e2e][process][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, true);
  int seed = 900;

  // B never answers A's pusher: the push fails after A's read timeout, B holds nothing of it
  // and B's lookup fetches the KV from A.
  pair.to_b.silent_accepts(true);
  {
    const double failed = pair.pushes("failed");
    const auto context = pair.publish(++seed);
    pair.wait_push("failed", failed);
    CHECK(fault_entries(pair.node_b) == 0);
    pair.check_hit(context, pair.handoff(context), "peer:node-a");
    CHECK(fault_flush(pair.node_b) == 2);
  }
  pair.to_b.silent_accepts(false);
  double pushed = pair.pushes("pushed");
  const auto calibration = pair.publish(++seed);
  pair.wait_push("pushed", pushed);
  pair.check_hit(calibration, pair.handoff(calibration), "local");
  CHECK(fault_flush(pair.node_b) == 2);
  const std::size_t push_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_b.last_payload_length(Direction::kToSidecar, PeerMessage::kPushEncoded);
  const std::size_t chunk_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_b.last_payload_length(Direction::kToSidecar, PeerMessage::kChunk);

  // B falls silent on a working push connection: at the push header, at its chunks, at Committed.
  struct Silence {
    Direction direction;
    PeerMessage type;
  };
  const Silence silences[] = {{Direction::kToSidecar, PeerMessage::kPushEncoded},
                              {Direction::kToSidecar, PeerMessage::kChunk},
                              {Direction::kToClient, PeerMessage::kCommitted}};
  for (const auto& silence : silences) {
    INFO("silent from frame type " << static_cast<int>(silence.type));
    const double failed = pair.pushes("failed");
    const int applied = pair.to_b.faults_applied();
    pair.to_b.silence_from(silence.direction, silence.type);
    const auto context = pair.publish(++seed);
    pair.wait_push("failed", failed);
    CHECK(pair.to_b.faults_applied() == applied + 1);
    if (silence.type == PeerMessage::kCommitted) {
      // B had it all and filed it; only the answer was lost. A's push failed, B's KV is whole.
      CHECK(fault_store_keys(pair.node_b).contains(context.a_key));
      pair.check_hit(context, pair.handoff(context), "local");
    } else {
      CHECK(fault_entries(pair.node_b) == 0);
      pair.check_hit(context, pair.handoff(context), "peer:node-a");
    }
    CHECK(fault_flush(pair.node_b) == 2);
  }

  // The push cut mid-frame and closed.
  struct Cut {
    PeerMessage frame;
    std::size_t keep;
  };
  const Cut cuts[] = {{PeerMessage::kPushEncoded, 5},
                      {PeerMessage::kPushEncoded, 12 + 10},
                      {PeerMessage::kPushEncoded, push_frame - 1},
                      {PeerMessage::kChunk, 7},
                      {PeerMessage::kChunk, 12 + 10},
                      {PeerMessage::kChunk, chunk_frame / 2},
                      {PeerMessage::kChunk, chunk_frame - 1}};
  for (const auto& cut : cuts) {
    INFO("push cut after " << cut.keep << " bytes of frame type " << static_cast<int>(cut.frame));
    const double failed = pair.pushes("failed");
    const int applied = pair.to_b.faults_applied();
    pair.to_b.cut_frame(Direction::kToSidecar, cut.frame, cut.keep,
                        cut.frame == PeerMessage::kChunk ? std::optional(PeerMessage::kPushEncoded) : std::nullopt);
    const auto context = pair.publish(++seed);
    pair.wait_push("failed", failed);
    CHECK(pair.to_b.faults_applied() == applied + 1);
    CHECK(fault_entries(pair.node_b) == 0);
    CHECK_FALSE(fault_store_keys(pair.node_b).contains(context.a_key));
    pair.check_hit(context, pair.handoff(context), "peer:node-a");
    CHECK(fault_flush(pair.node_b) == 2);
  }
}

namespace {

// One push with a bit flipped on its way to B: B must file nothing, or exactly A's KV under
// A's key (a flip the transfer does not depend on), and B's next lookup gets A's KV either way
// (from its store or fetched), answering as the tokens run does. Returns a description of
// what went wrong, empty when nothing did.
std::string fault_push_flip(FaultPair& pair, int seed, PeerMessage frame, std::size_t byte, unsigned bit) {
  const double before = pair.pushes("pushed") + pair.pushes("failed");
  const int applied = pair.to_b.faults_applied();
  pair.to_b.flip_bit(Direction::kToSidecar, frame, byte, bit,
                     frame == PeerMessage::kChunk ? std::optional(PeerMessage::kPushEncoded) : std::nullopt);
  const auto context = pair.publish(seed);
  const bool settled =
      wait_until([&] { return pair.pushes("pushed") + pair.pushes("failed") > before; }, std::chrono::seconds(20));
  const bool flipped = pair.to_b.faults_applied() == applied + 1;
  const auto b_keys = fault_store_keys(pair.node_b);
  const bool filed = b_keys.contains(context.a_key);
  bool clean = b_keys.size() == (filed ? 1U : 0U);  // nothing under any other key
  if (filed)
    clean = clean && fault_entry_bytes(pair.node_b, context.a_key) == fault_entry_bytes(pair.node_a, context.a_key);
  const auto b = pair.handoff(context);
  const bool served = b["kvrelay"]["cached_tokens"] == 208 &&
                      fault_last_lookup(pair.node_b).value("kv_from", "") == (filed ? "local" : "peer:node-a");
  const bool as_tokens = b["choices"][0]["token_ids"] == context.reference_tokens;
  fault_flush(pair.node_b);
  if (settled && flipped && clean && served && as_tokens) return {};
  return std::string(frame == PeerMessage::kChunk ? "chunk" : "push header") + " byte " + std::to_string(byte) +
         " bit " + std::to_string(bit) + ": settled " + std::to_string(settled) + ", flipped " +
         std::to_string(flipped) + ", filed " + std::to_string(filed) + ", " + std::to_string(b_keys.size()) +
         " keys on B, clean " + std::to_string(clean) + ", served " + std::to_string(served) + ", as tokens " +
         std::to_string(as_tokens);
}

// The EntryKey in PushEncoded's payload: after the frame header and the u64 transfer id
// (docs/wire-format.md); only the bug case below names it.
constexpr std::size_t kFaultPushKeyFirst = 12 + 8;
constexpr std::size_t kFaultPushKeyBytes = 16;

}  // namespace

TEST_CASE("fault: seeded single-bit flips of a push's frames: B files nothing corrupted",
          "[kv_path][e2e][process][fault][flips]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, true);
  const double pushed = pair.pushes("pushed");
  const auto calibration = pair.publish(1'000);
  pair.wait_push("pushed", pushed);
  CHECK(fault_flush(pair.node_b) == 1);
  const std::size_t push_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_b.last_payload_length(Direction::kToSidecar, PeerMessage::kPushEncoded);
  const std::size_t chunk_frame =
      kvrelay::peer::kPeerHeaderBytes + pair.to_b.last_payload_length(Direction::kToSidecar, PeerMessage::kChunk);
  REQUIRE(push_frame > kFaultPushKeyFirst + kFaultPushKeyBytes);
  REQUIRE(chunk_frame > 32);

  // 32 flips in the push's own frame (the key aside: see the bug case), 32 in the chunk's two
  // headers, 32 in its body.
  std::mt19937_64 rng(25);
  std::vector<std::string> failures;
  int seed = 1'000;
  for (int index = 0; index < 96; ++index) {
    PeerMessage frame = PeerMessage::kChunk;
    std::size_t byte = 0;
    if (index < 32) {
      frame = PeerMessage::kPushEncoded;
      do {
        byte = rng() % push_frame;
      } while (byte >= kFaultPushKeyFirst && byte < kFaultPushKeyFirst + kFaultPushKeyBytes);
    } else if (index < 64) {
      byte = rng() % 32;
    } else {
      byte = 32 + rng() % (chunk_frame - 32);
    }
    const auto bit = static_cast<unsigned>(rng() % 8);
    if (auto failure = fault_push_flip(pair, ++seed, frame, byte, bit); !failure.empty()) failures.push_back(failure);
  }
  for (const auto& failure : failures)
    UNSCOPED_INFO(failure);
  CHECK(failures.empty());
}

// A push's key has nothing to be checked against on B (a fetch reply's has the hashes asked
// for): the chunks' running checksums cover the stream header, key included, so a flipped key
// bit fails the first chunk instead of filing A's KV under a key A never had.
TEST_CASE("fault: a push whose key has a flipped bit is not filed under that key", "[kv_path][e2e][process][fault]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  FaultPair pair(*model, true);
  const double pushed = pair.pushes("pushed");
  pair.publish(1'100);
  pair.wait_push("pushed", pushed);
  CHECK(fault_flush(pair.node_b) == 1);
  std::vector<std::string> failures;
  int seed = 1'100;
  for (std::size_t byte = kFaultPushKeyFirst; byte < kFaultPushKeyFirst + kFaultPushKeyBytes; ++byte) {
    for (const unsigned bit : {0U, 5U}) {
      if (auto failure = fault_push_flip(pair, ++seed, PeerMessage::kPushEncoded, byte, bit); !failure.empty())
        failures.push_back(failure);
    }
  }
  for (const auto& failure : failures)
    UNSCOPED_INFO(failure);
  CHECK(failures.empty());
}
