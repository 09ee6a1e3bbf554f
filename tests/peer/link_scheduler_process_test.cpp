// Issue #27 on the daemon's own path: a real `kvrelay serve` schedules the fetch replies it sends
// with its link queues. A peer fetches a large entry on a low-priority route, then a small one
// on an urgent route over the same link. Under the scheduler the urgent reply preempts the bulk
// one at a chunk boundary and the bulk one resumes where it stopped; under FIFO it waits. Judged
// by order and counts, never by timings.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <future>
#include <string>
#include <thread>

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
// exist for the weights their fetches get.
json scheduled_policy(const std::string& mode) {
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
      {{"id", "bulk"}, {"from", "archiver"}, {"to", "coder"}, {"priority", 0}},
      {{"id", "urgent"}, {"from", "planner"}, {"to", "coder"}, {"priority", 7}},
  });
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
