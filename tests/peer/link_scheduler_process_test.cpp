// Issue #27 on the daemon's own path: a real `kvrelay serve` schedules the fetch replies it sends
// with its link queues. A peer fetches a large entry on a low-priority route, then a small one
// on an urgent route over the same link. Under the scheduler the urgent reply preempts the bulk
// one at a chunk boundary and the bulk one resumes where it stopped; under FIFO it waits. Judged
// by order and counts, never by timings.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cmath>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/broker/peer_links.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/peer/peer_client.h"

#include "support/peer_fixture.h"

using namespace kvrelay;
using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::size_t kBulkBytes = 48U << 20;
constexpr std::size_t kUrgentBytes = 1U << 20;
constexpr std::uint64_t kModel = 11;
constexpr const char* kAsker = "node-b";

// Agents on this node only (no policy peers, so loopback peers are not restricted): the routes
// exist for the weights their fetches get, `low` at priority 0 from archiver, `high` at 7 from
// planner (role_priority 7).
json two_route_policy(const std::string& low, const std::string& high) {
  const json model = {{"architecture", "llama"}, {"layers", 2},     {"kv_heads", 2},
                      {"head_dim", 64},          {"dtype", "fp16"}, {"weights", "m"}};
  auto policy = basic_daemon_policy();
  policy["node"]["id"] = "node-a";
  policy["listen"]["peer"] = "127.0.0.1:0";
  policy["limits"] = {{"read_timeout_ms", 10000}, {"kv_store_bytes", 256U << 20}, {"peer_summary_interval_ms", 0}};
  policy["agents"] = json::array({
      {{"id", "archiver"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", 0}},
      {{"id", "planner"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", 7}},
      {{"id", "coder"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", 0}},
  });
  policy["routes"] = json::array({
      {{"id", low}, {"from", "archiver"}, {"to", "coder"}, {"priority", 0}},
      {{"id", high}, {"from", "planner"}, {"to", "coder"}, {"priority", 7}},
  });
  return policy;
}

json scheduled_policy(const std::string& mode) {
  auto policy = two_route_policy("bulk", "urgent");
  // The pacer plays a 48 MB/s NIC so the bulk reply is still early when the urgent one arrives;
  // beta 1 keeps the bulk reply's aging weight from outgrowing the urgent one meanwhile.
  policy["scheduler"] = {{"mode", mode}, {"link_bytes_per_s", 48e6}, {"beta", 1.0}};
  return policy;
}

peer::PeerClient connect_as(const HostPort& address, const std::string& node_id) {
  peer::PeerClientOptions options;
  options.node_id = node_id;
  options.read_timeout = std::chrono::seconds(10);
  auto client = peer::PeerClient::connect(address, options);
  if (!client) FAIL("peer connect: " << client.error().to_string());
  return std::move(client).value();
}

json admin_state(const DaemonUnderTest& daemon) {
  const auto reply = http_request(daemon.admin_port(), "GET", "/admin/state?limit=1024");
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

std::uint64_t link_bytes(const json& state, const std::string& peer) {
  if (!state["links"].contains(peer)) return 0;
  std::uint64_t total = 0;
  for (const auto& [klass, bytes] : state["links"][peer]["bytes"].items())
    total += bytes.get<std::uint64_t>();
  return total;
}

struct Fetched {
  std::vector<std::byte> kv;
  std::uint64_t frame_bytes = 0;
};

Fetched fetch_on(peer::PeerClient& client, std::uint64_t id, const KvFrame& frame, const std::string& route) {
  peer::FetchRequest request{id, kModel, "raw", {frame.key(kModel).context_hash}};
  request.route = route;
  auto fetched = client.fetch(request, std::uint64_t{1} << 31);
  if (!fetched) FAIL("fetch on " << route << ": " << fetched.error().to_string());
  if (!fetched.value()) FAIL("fetch on " << route << ": the daemon holds none");
  return {decoded_kv(fetched.value()->frame()), fetched.value()->frame_bytes};
}

struct Run {
  bool urgent_first = false;  // the daemon completed the urgent reply before the bulk one
  Fetched bulk;
  Fetched urgent;
  json state;
};

// The seq of the daemon's "completed" link event for the reply on `route`: replies that left
// earlier have smaller ones.
std::uint64_t completed_seq(const json& state, const std::string& route) {
  for (const auto& event : state["link_events"])
    if (event["kind"] == "completed" && event["route"] == route) return event["seq"].get<std::uint64_t>();
  FAIL("no completed transfer on route " << route << " in the link events");
  return 0;
}

// Files the frames in the daemon as a peer's pushes would, transfer ids 1, 2, ...
void load(const HostPort& address, const std::vector<const KvFrame*>& frames) {
  auto loader = connect_as(address, "loader");
  std::uint64_t id = 1;
  for (const KvFrame* frame : frames)
    REQUIRE(loader.push_encoded(id++, frame->key(kModel), frame->chain, frame->bytes()).has_value());
}

// Loads both entries into the daemon (pushed as a peer would), starts the bulk fetch, and once
// its first chunks have left, the urgent one.
Run bulk_then_urgent(DaemonUnderTest& daemon, std::uint16_t peer_port, const KvFrame& bulk, const KvFrame& urgent) {
  const HostPort address{"127.0.0.1", peer_port};
  load(address, {&bulk, &urgent});
  auto bulk_client = connect_as(address, kAsker);
  auto urgent_client = connect_as(address, kAsker);
  auto bulk_fetch = std::async(std::launch::async, [&] { return fetch_on(bulk_client, 10, bulk, "bulk"); });
  // The bulk reply has started: some of it is granted, most is not.
  REQUIRE(wait_until([&] { return link_bytes(admin_state(daemon), kAsker) >= (2U << 20); }, std::chrono::seconds(20)));
  Run run;
  run.urgent = fetch_on(urgent_client, 11, urgent, "urgent");
  run.bulk = bulk_fetch.get();
  run.state = admin_state(daemon);
  run.urgent_first = completed_seq(run.state, "urgent") < completed_seq(run.state, "bulk");
  return run;
}

}  // namespace

TEST_CASE("The daemon's link scheduler preempts a bulk fetch reply for an urgent one, which resumes without resending",
          "[scheduler]") {
  const auto bulk = kv_frame(kBulkBytes, 1);
  const auto urgent = kv_frame(kUrgentBytes, 2);
  DaemonUnderTest daemon(scheduled_policy("wrr"));
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const auto run = bulk_then_urgent(daemon, ready["peer"].get<std::uint16_t>(), bulk, urgent);

  CHECK(run.urgent_first);
  CHECK(same_bytes(run.bulk.kv, bulk.kv));  // resumed at its breakpoint, byte for byte
  CHECK(same_bytes(run.urgent.kv, urgent.kv));
  INFO(run.state.dump(2));
  const auto& link = run.state["links"][kAsker];
  CHECK(link["preemptions"].get<int>() >= 1);
  CHECK(link["resumes"].get<int>() >= 1);
  CHECK(link["completed"].get<int>() == 2);
  // Every byte was granted once: no committed chunk went twice.
  CHECK(link_bytes(run.state, kAsker) == run.bulk.frame_bytes + run.urgent.frame_bytes);
  CHECK(link["queue_depth"].get<int>() == 0);
  // The event ring names the routes: the urgent reply took the link from the bulk one.
  bool urgent_preempted_bulk = false;
  for (const auto& event : run.state["link_events"]) {
    if (event["kind"] == "preempted" && event["route"] == "bulk") urgent_preempted_bulk = true;
  }
  CHECK(urgent_preempted_bulk);
  CHECK(run.state["scheduler"]["mode"] == "wrr");
  CHECK(run.state["agents"].is_object());  // none has a metrics_url here
  CHECK(run.state["memory"]["entries"].get<int>() == 2);
  // The same figures at /metrics.
  const auto metrics = http_request(daemon.admin_port(), "GET", "/metrics");
  REQUIRE(metrics.status == 200);
  CHECK(metrics.body.find("kvrelay_link_preemptions_total{peer=\"node-b\"}") != std::string::npos);
}

TEST_CASE("Under scheduler.mode fifo the urgent fetch reply waits for the bulk one", "[scheduler]") {
  const auto bulk = kv_frame(kBulkBytes, 3);
  const auto urgent = kv_frame(kUrgentBytes, 4);
  DaemonUnderTest daemon(scheduled_policy("fifo"));
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const auto run = bulk_then_urgent(daemon, ready["peer"].get<std::uint16_t>(), bulk, urgent);

  CHECK_FALSE(run.urgent_first);
  CHECK(same_bytes(run.bulk.kv, bulk.kv));
  CHECK(same_bytes(run.urgent.kv, urgent.kv));
  INFO(run.state.dump(2));
  CHECK(run.state["links"][kAsker]["preemptions"].get<int>() == 0);
  CHECK(link_bytes(run.state, kAsker) == run.bulk.frame_bytes + run.urgent.frame_bytes);
}

TEST_CASE("With scheduler.mode off fetch replies are not queued and /admin/state says so", "[scheduler]") {
  const auto entry = kv_frame(kUrgentBytes, 5);
  DaemonUnderTest daemon(scheduled_policy("off"));
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const HostPort address{"127.0.0.1", ready["peer"].get<std::uint16_t>()};
  auto client = connect_as(address, kAsker);
  REQUIRE(client.push_encoded(1, entry.key(kModel), entry.chain, entry.bytes()).has_value());
  CHECK(same_bytes(fetch_on(client, 2, entry, "urgent").kv, entry.kv));
  const auto state = admin_state(daemon);
  CHECK(state["scheduler"]["mode"] == "off");
  CHECK(state["links"].empty());
}

namespace {

class FixedPolicy final : public broker::PolicySource {
 public:
  explicit FixedPolicy(const json& document) {
    auto parsed = parse_policy(document.dump(), "link_scheduler_process_test");
    REQUIRE(parsed);
    policy_ = std::make_shared<const Policy>(std::move(parsed).value());
  }
  [[nodiscard]] std::shared_ptr<const Policy> current() const override { return policy_; }
  void set_engine_observer(EngineObserver /*observer*/) override {}

 private:
  std::shared_ptr<const Policy> policy_;
};

}  // namespace

TEST_CASE(
    "A sidecar's fetches from one peer run on separate connections, so the peer's scheduler puts the urgent "
    "reply first",
    "[scheduler]") {
  const auto bulk = kv_frame(kBulkBytes, 6);
  const auto urgent = kv_frame(kUrgentBytes, 7);
  DaemonUnderTest daemon(scheduled_policy("wrr"));
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const std::uint16_t peer_port = ready["peer"].get<std::uint16_t>();
  load({"127.0.0.1", peer_port}, {&bulk, &urgent});
  // This process plays node-b's sidecar: its broker's peer links, as its KV path fetches.
  const json b_policy = {
      {"schema_version", 1},
      {"node", {{"id", kAsker}}},
      {"listen", {{"http", "127.0.0.1:0"}}},
      {"peers", json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(peer_port)}}})},
      {"limits", {{"read_timeout_ms", 10000}, {"peer_summary_interval_ms", 0}}}};
  metrics::Registry registry;
  broker::PeerLinks links(std::make_shared<FixedPolicy>(b_policy), registry);
  const auto codecs = codec::CodecRegistry::with_builtins();
  const auto fetch = [&](std::uint64_t id, const KvFrame& frame, const std::string& route) {
    peer::FetchRequest request{id, kModel, "raw", {frame.key(kModel).context_hash}};
    request.route = route;
    auto fetched = links.fetch("node-a", request, peer::Deadline::max(), std::uint64_t{1} << 31, codecs);
    if (!fetched || !fetched.value()) return std::vector<std::byte>{};
    return decoded_kv(fetched.value()->frame());
  };
  auto bulk_fetch = std::async(std::launch::async, [&] { return fetch(20, bulk, "bulk"); });
  REQUIRE(wait_until([&] { return link_bytes(admin_state(daemon), kAsker) >= (2U << 20); }, std::chrono::seconds(20)));
  const auto urgent_kv = fetch(21, urgent, "urgent");
  const auto bulk_kv = bulk_fetch.get();
  CHECK(same_bytes(urgent_kv, urgent.kv));
  CHECK(same_bytes(bulk_kv, bulk.kv));
  const auto state = admin_state(daemon);
  INFO(state.dump(2));
  CHECK(completed_seq(state, "urgent") < completed_seq(state, "bulk"));
  CHECK(state["links"][kAsker]["preemptions"].get<int>() >= 1);
}

TEST_CASE("role_priority decides the order in which transfers queued on one link leave", "[scheduler]") {
  const json model = {{"architecture", "llama"}, {"layers", 2},     {"kv_heads", 2},
                      {"head_dim", 64},          {"dtype", "fp16"}, {"weights", "m"}};
  auto policy = basic_daemon_policy();
  policy["node"]["id"] = "node-a";
  policy["listen"]["peer"] = "127.0.0.1:0";
  policy["limits"] = {{"read_timeout_ms", 10000}, {"kv_store_bytes", 256U << 20}, {"peer_summary_interval_ms", 0}};
  policy["agents"] = json::array();
  policy["routes"] = json::array();
  policy["agents"].push_back(
      {{"id", "sink"}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", 0}});
  for (const int priority : {1, 4, 7}) {
    const std::string agent = "agent-" + std::to_string(priority);
    policy["agents"].push_back(
        {{"id", agent}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", priority}});
    policy["routes"].push_back({{"id", "from-" + agent}, {"from", agent}, {"to", "sink"}});
  }
  // A 16 MB/s link: the three 4 MiB replies share it for about a second, so when each was asked
  // (milliseconds apart) hardly matters; beta 0.1 keeps aging from overtaking the priorities.
  policy["scheduler"] = {{"mode", "wrr"}, {"link_bytes_per_s", 16e6}, {"beta", 0.1}};
  DaemonUnderTest daemon(policy);
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const HostPort address{"127.0.0.1", ready["peer"].get<std::uint16_t>()};
  const std::vector<KvFrame> frames{kv_frame(4U << 20, 11), kv_frame(4U << 20, 12), kv_frame(4U << 20, 13)};
  load(address, {&frames[0], &frames[1], &frames[2]});
  std::vector<std::future<Fetched>> fetches;
  const std::vector<int> priorities{1, 4, 7};  // asked in this order, lowest first
  for (std::size_t index = 0; index < priorities.size(); ++index) {
    fetches.push_back(std::async(std::launch::async, [&, index] {
      auto client = connect_as(address, kAsker);
      return fetch_on(client, 30 + index, frames[index], "from-agent-" + std::to_string(priorities[index]));
    }));
  }
  for (std::size_t index = 0; index < fetches.size(); ++index)
    CHECK(same_bytes(fetches[index].get().kv, frames[index].kv));
  const auto state = admin_state(daemon);
  INFO(state.dump(2));
  CHECK(completed_seq(state, "from-agent-7") < completed_seq(state, "from-agent-4"));
  CHECK(completed_seq(state, "from-agent-4") < completed_seq(state, "from-agent-1"));
}

// S15 case 2, no starvation: aging lets a low-priority fetch reply through while four clients
// keep high-priority fetches on the same link back to back.
namespace {

constexpr std::size_t kHotBytes = 1U << 20;
constexpr std::size_t kColdBytes = 8U << 20;
constexpr int kHotClients = 4;
// Each hot client stops after this many fetches: with the cold fetch's 8 MiB the link carries
// at most 48 MiB (4 x 10 MiB hot). More than the bound below plus the completions before the
// cold fetch opens, so a starved cold reply fails the bound rather than waiting for the end.
constexpr int kHotFetchesPerClient = 10;
constexpr double kPacedBytesPerS = 64e6;
constexpr std::uint64_t kChunkBytes = 256U << 10;  // scheduler.chunk_bytes' default
// scheduler.base, alpha and beta as the policy sets them.
constexpr double kBase = 1.0;
constexpr double kAlpha = 1.0;
constexpr double kBeta = 20.0;
// role_priority(planner) 7 + role_priority(coder) 0 + routes[hot].priority 7; the cold route's
// agents and route weigh 0.
constexpr double kHotStatic = 7 + 0 + 7;
// The longest a hot transfer asks while others are granted before it completes (its own aging):
// its 4 chunks behind at most the other three hot replies' 4 chunks each, plus the cold reply's
// 10 ms time slice: 16 chunks at 64 MB/s and 10 ms, 0.076 s.
constexpr double kHotAgeS = 0.08;

// The most hot completions the daemon's event ring may show between the cold reply's "opened"
// and its "completed" (docs/configuration.md: weight = prio(from) + prio(to) + route priority
// + base + alpha * exp(beta * queue_delay)):
//  1. The hot replies already open when the cold one opens: at most kHotClients.
//  2. Until the cold reply's aging term outweighs all hot replies together, it may get nothing.
//     A hot reply weighs at most W_hot = kHotStatic + base + alpha * exp(beta * kHotAgeS) (20);
//     the cold one, base + alpha * exp(beta * d) after asking d seconds, outweighs kHotClients *
//     W_hot once d >= d* = ln((kHotClients * W_hot - base) / alpha) / beta (0.22 s). The pacer
//     lets at most burst (2 chunks) + rate * d* bytes through by then: as many MiB of hot
//     replies complete, at most (14).
//  3. After d*, smooth weighted round robin gives the cold reply at least every other grant (and
//     a hot reply, lighter than preempt_factor times it, never preempts it): while it sends its
//     remaining <= 8 MiB, at most as many hot bytes go (8).
//  4. One hot reply per client finishing the chunks it was granted.
// 30 in all. The margin is in the worst cases: no grant at all to the cold reply before d*,
// every hot reply aged to the most it can be (measured: 12-14). A starved cold reply would see
// nearly all the hot fetches left when it opened complete first (the 40 less the 4 or so done).
int hot_completions_bound() {
  const double hot_weight = kHotStatic + kBase + kAlpha * std::exp(kBeta * kHotAgeS);
  const double aged_s = std::log((kHotClients * hot_weight - kBase) / kAlpha) / kBeta;
  const double until_aged = 2.0 * static_cast<double>(kChunkBytes) + kPacedBytesPerS * aged_s;
  const double in_flight = kHotClients;
  const double starved = std::ceil(until_aged / static_cast<double>(kHotBytes));
  const double shared = std::ceil(static_cast<double>(kColdBytes) / static_cast<double>(kHotBytes));
  return static_cast<int>(in_flight + starved + shared + kHotClients);
}

json starvation_policy() {
  auto policy = two_route_policy("cold", "hot");
  policy["scheduler"] = {{"mode", "wrr"}, {"link_bytes_per_s", kPacedBytesPerS}, {"base", kBase}, {"alpha", kAlpha},
                         {"beta", kBeta}, {"chunk_bytes", kChunkBytes}};
  return policy;
}

// A fetch on a client thread: no Catch2 assertions off the test's thread, only what happened.
struct ThreadFetch {
  bool exact = false;  // the decoded KV is the loaded entry's, byte for byte
  std::uint64_t frame_bytes = 0;
  std::string error;
};

ThreadFetch fetch_quietly(peer::PeerClient& client, std::uint64_t id, const KvFrame& frame, const std::string& route) {
  peer::FetchRequest request{id, kModel, "raw", {frame.key(kModel).context_hash}};
  request.route = route;
  ThreadFetch out;
  auto fetched = client.fetch(request, std::uint64_t{1} << 31);
  if (!fetched) {
    out.error = "fetch on " + route + ": " + fetched.error().to_string();
    return out;
  }
  if (!fetched.value()) {
    out.error = "fetch on " + route + ": the daemon holds none";
    return out;
  }
  out.frame_bytes = fetched.value()->frame_bytes;
  const auto registry = codec::CodecRegistry::with_builtins();
  auto kv = codec::decode_frame(registry, fetched.value()->frame(), std::uint64_t{1} << 32);
  if (!kv) {
    out.error = "decode on " + route + ": " + kv.error().to_string();
    return out;
  }
  out.exact = same_bytes(std::as_bytes(std::span(kv.value())), frame.kv);
  return out;
}

struct HotClientRun {
  int fetches = 0;
  int inexact = 0;
  std::uint64_t frame_bytes = 0;
  bool ran_out = false;  // stopped at kHotFetchesPerClient before the cold fetch returned
  std::string error;
};

}  // namespace

TEST_CASE("Aging lets a low-priority fetch reply through while high-priority ones keep the link busy", "[scheduler]") {
  std::vector<KvFrame> hot;
  for (int client = 0; client < kHotClients; ++client)
    hot.push_back(kv_frame(kHotBytes, 40 + static_cast<std::uint64_t>(client)));
  const auto cold = kv_frame(kColdBytes, 50);
  DaemonUnderTest daemon(starvation_policy());
  const auto ready = json::parse(read_file(daemon.dir() / "ready.json"));
  const HostPort address{"127.0.0.1", ready["peer"].get<std::uint16_t>()};
  load(address, {&hot[0], &hot[1], &hot[2], &hot[3], &cold});

  std::vector<peer::PeerClient> clients;
  for (int client = 0; client < kHotClients; ++client)
    clients.push_back(connect_as(address, kAsker));
  auto cold_client = connect_as(address, kAsker);
  std::atomic<bool> cold_done{false};
  std::atomic<std::uint64_t> next_id{100};
  std::vector<HotClientRun> runs(kHotClients);
  std::vector<std::thread> threads;
  for (int client = 0; client < kHotClients; ++client) {
    threads.emplace_back([&, client] {
      HotClientRun& run = runs[static_cast<std::size_t>(client)];
      while (!cold_done.load() && run.fetches < kHotFetchesPerClient) {
        const auto fetched = fetch_quietly(clients[static_cast<std::size_t>(client)], next_id++,
                                           hot[static_cast<std::size_t>(client)], "hot");
        if (!fetched.error.empty()) {
          run.error = fetched.error;
          return;
        }
        ++run.fetches;
        run.inexact += fetched.exact ? 0 : 1;
        run.frame_bytes += fetched.frame_bytes;
      }
      run.ran_out = !cold_done.load();
    });
  }
  // The cold fetch starts among them: once the hot replies have the link.
  const bool busy = wait_until(
      [&] {
        const auto state = admin_state(daemon);
        return state["links"].contains(kAsker) && state["links"][kAsker]["completed"].get<int>() >= kHotClients;
      },
      std::chrono::seconds(20));
  const auto cold_fetch = fetch_quietly(cold_client, next_id++, cold, "cold");
  cold_done = true;
  for (auto& thread : threads)
    thread.join();
  REQUIRE(busy);
  REQUIRE(cold_fetch.error.empty());

  // The cold reply's bytes arrived byte for byte, and every hot reply's too.
  CHECK(cold_fetch.exact);
  std::uint64_t hot_frame_bytes = 0;
  int hot_fetches = 0;
  for (const auto& run : runs) {
    CHECK(run.error.empty());
    CHECK(run.inexact == 0);
    // The hot clients were still fetching when the cold fetch returned: it was not served only
    // once they ran out.
    CHECK_FALSE(run.ran_out);
    hot_frame_bytes += run.frame_bytes;
    hot_fetches += run.fetches;
  }
  // The daemon closes a reply's ticket once its last chunk is acknowledged, which may be just
  // after the client has the frame: wait until every reply counts as completed.
  json state;
  (void)wait_until(
      [&] {
        state = admin_state(daemon);
        return state["links"][kAsker].value("completed", 0) >= hot_fetches + 1;
      },
      std::chrono::seconds(10));
  INFO(state.dump(2));

  // The event ring, in seq order: the cold reply's "opened" and "completed", and the hot
  // completions between them.
  const json& events = state["link_events"];
  std::optional<std::uint64_t> cold_opened;
  std::optional<std::uint64_t> cold_completed;
  std::uint64_t cold_ticket = 0;
  for (const auto& event : events) {
    if (event["route"] != "cold") continue;
    if (event["kind"] == "opened") {
      cold_opened = event["seq"].get<std::uint64_t>();
      cold_ticket = event["transfer"].get<std::uint64_t>();
    }
    if (event["kind"] == "completed") cold_completed = event["seq"].get<std::uint64_t>();
  }
  REQUIRE(cold_opened);
  REQUIRE(cold_completed);  // the low-priority transfer completed
  REQUIRE(*cold_opened < *cold_completed);
  int hot_between = 0;
  std::uint64_t previous_seq = 0;
  bool contiguous = true;
  for (const auto& event : events) {
    const auto seq = event["seq"].get<std::uint64_t>();
    contiguous = contiguous && (previous_seq == 0 || seq == previous_seq + 1);
    previous_seq = seq;
    if (event["route"] == "hot" && event["kind"] == "completed" && seq > *cold_opened && seq < *cold_completed)
      ++hot_between;
  }
  CHECK(contiguous);  // the ring dropped nothing we count over
  CHECK(state["link_events_dropped"].get<int>() == 0);
  CHECK(cold_ticket != 0);
  const int bound = hot_completions_bound();
  // The bound says something: below what a starved cold reply would see.
  CHECK(bound < kHotClients * (kHotFetchesPerClient - 1));
  INFO("hot completions between the cold reply's open and completion: " << hot_between << " (bound " << bound
                                                                        << "); hot fetches " << hot_fetches);
  // The link was contended while the cold reply was open: hot replies kept completing.
  CHECK(hot_between >= kHotClients);
  CHECK(hot_between <= bound);
  // Every transfer completed, and every granted byte was one of theirs: no chunk went twice.
  const auto& link = state["links"][kAsker];
  CHECK(link["completed"].get<int>() == hot_fetches + 1);
  CHECK(link["aborted"].get<int>() == 0);
  CHECK(link["stall_guards"].get<int>() == 0);  // aging did it, not the stall guard
  CHECK(link_bytes(state, kAsker) == hot_frame_bytes + cold_fetch.frame_bytes);
  CHECK(link_bytes(state, kAsker) <= (48U << 20) + (1U << 20));
}
