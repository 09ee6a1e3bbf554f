// broker::LinkQueues on its own: the gate every peer chunk will ask, with the real
// decision::LinkScheduler behind it. A fake clock makes the scheduling and pacing cases
// deterministic; the thread cases hold answers with promises and latches, never sleeps.

#include "kvrelay/broker/link_queues.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <map>
#include <thread>

using namespace kvrelay;
using broker::LinkEventKind;
using broker::LinkQueues;
using broker::LinkQueuesOptions;
using peer::TransferPurpose;
using peer::TransferTag;

namespace {

constexpr const char* kPolicy = R"({
  "schema_version": 1,
  "node": {"id": "node-a"},
  "listen": {"http": "127.0.0.1:0", "peer": "127.0.0.1:0"},
  "peers": [{"id": "node-b", "address": "127.0.0.1:7070"}],
  "agents": [
    {"id": "low", "upstream": "http://127.0.0.1:8000", "role_priority": 0,
     "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp32", "weights": "m"}},
    {"id": "mid", "upstream": "http://127.0.0.1:8001", "role_priority": 4,
     "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp32", "weights": "m"}},
    {"id": "one", "upstream": "http://127.0.0.1:8003", "role_priority": 1,
     "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp32", "weights": "m"}},
    {"id": "high", "upstream": "http://127.0.0.1:8002", "role_priority": 7,
     "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp32", "weights": "m"}},
    {"id": "remote", "node": "node-b", "upstream": "http://127.0.0.1:9000", "role_priority": 6,
     "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp32", "weights": "m"}}
  ],
  "routes": [
    {"id": "bulk", "from": "low", "to": "remote", "priority": 0},
    {"id": "urgent", "from": "high", "to": "remote", "priority": 7},
    {"id": "mid-route", "from": "mid", "to": "remote", "priority": 2, "deadline_ms": 5000},
    {"id": "one-route", "from": "one", "to": "remote", "priority": 2}
  ]
})";

class TestPolicy final : public broker::PolicySource {
 public:
  explicit TestPolicy(std::string_view text) {
    auto parsed = parse_policy(text, "link_queues_test");
    REQUIRE(parsed);
    policy_ = std::make_shared<const Policy>(std::move(parsed.value()));
  }
  [[nodiscard]] std::shared_ptr<const Policy> current() const override { return policy_; }
  void set_engine_observer(EngineObserver /*observer*/) override {}

 private:
  std::shared_ptr<const Policy> policy_;
};

// A steady_clock that moves only when the test says so.
struct FakeClock {
  std::chrono::steady_clock::time_point base = std::chrono::steady_clock::now();
  std::atomic<std::int64_t> offset_ns{0};
  void advance(std::chrono::nanoseconds by) { offset_ns += by.count(); }
  [[nodiscard]] std::chrono::steady_clock::time_point now() const {
    return base + std::chrono::nanoseconds(offset_ns.load());
  }
  LinkQueuesOptions::Clock fn() {
    return [this] { return now(); };
  }
};

decision::SchedulerConfig small_chunks(std::uint32_t window = 2) {
  decision::SchedulerConfig config;
  config.chunk_bytes = 1024;
  config.window_chunks = window;
  return config;
}

TransferTag tag(std::string route, std::uint64_t bytes, TransferPurpose purpose = TransferPurpose::kFetchReply) {
  TransferTag out;
  out.peer = "node-b";
  out.route = std::move(route);
  out.purpose = purpose;
  out.bytes = bytes;
  return out;
}

std::unique_ptr<LinkQueues> make_queues(metrics::Registry& registry, decision::SchedulerConfig config,
                                        LinkQueuesOptions options) {
  auto queues = LinkQueues::create(std::make_shared<TestPolicy>(kPolicy), config, registry, std::move(options));
  REQUIRE(queues);
  return std::move(queues.value());
}

// Senders the way send_chunk_stream behaves: each asks for its next chunk as soon as one is
// granted, and the receiver acknowledges chunks in the order they were sent.
struct Senders {
  explicit Senders(LinkQueues& gate) : queues(gate) {}
  LinkQueues& queues;
  std::deque<std::uint64_t> unacked;  // tickets, in grant order
  std::vector<std::uint64_t> grants;
  std::map<std::uint64_t, int> left;  // chunks each has still to ask for

  void start(std::uint64_t ticket, int chunks) {
    left[ticket] = chunks;
    ask(ticket);
  }
  void ask(std::uint64_t ticket) {
    if (left[ticket] == 0) return;
    --left[ticket];
    queues.request(ticket, 1024, [this, ticket] {
      grants.push_back(ticket);
      unacked.push_back(ticket);
      ask(ticket);  // calls back into the queues: the callback runs outside their lock
    });
  }
  bool ack_one() {
    if (unacked.empty()) return false;
    const auto ticket = unacked.front();
    unacked.pop_front();
    queues.acknowledged(ticket, 1024);
    return true;
  }
};

std::size_t count_kind(const std::vector<broker::LinkEvent>& events, LinkEventKind kind) {
  std::size_t n = 0;
  for (const auto& e : events)
    n += e.kind == kind ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("A tag becomes a TransferSpec from the parsed policy") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  options.reserved_share = [](const RoutePolicy& route) { return route.id == "urgent" ? 0.3 : 0.0; };
  auto queues = make_queues(registry, small_chunks(), std::move(options));
  TestPolicy source(kPolicy);
  const Policy& policy = *source.current();

  const auto fetch = queues->spec_for(tag("mid-route", 4096), policy, 1, 10.0);
  CHECK(fetch.id == 1);
  CHECK(fetch.bytes == 4096);
  CHECK(fetch.src_priority == 4);  // mid
  CHECK(fetch.dst_priority == 6);  // remote
  CHECK(fetch.route_priority == 2);
  CHECK(fetch.klass == decision::TransferClass::kNormal);
  REQUIRE(fetch.deadline_s);
  CHECK(*fetch.deadline_s == Approx(15.0));  // now + routes[].deadline_ms

  TransferTag with_deadline = tag("mid-route", 10, TransferPurpose::kPush);
  with_deadline.deadline = clock.now() + std::chrono::seconds(2);  // the tag's own deadline wins
  const auto push = queues->spec_for(with_deadline, policy, 2, 0.0);
  REQUIRE(push.deadline_s);
  CHECK(*push.deadline_s == Approx(2.0));
  CHECK(push.src_priority == 4);

  const auto spill = queues->spec_for(tag("mid-route", 10, TransferPurpose::kSpill), policy, 3, 0.0);
  CHECK(spill.klass == decision::TransferClass::kNormal);
  CHECK(spill.src_priority + spill.dst_priority + spill.route_priority == 0);
  CHECK_FALSE(spill.deadline_s);

  const auto prefetch = queues->spec_for(tag("mid-route", 10, TransferPurpose::kPrefetch), policy, 4, 0.0);
  CHECK(prefetch.klass == decision::TransferClass::kPrefetch);
  CHECK(prefetch.src_priority == 4);
  CHECK_FALSE(prefetch.deadline_s);  // background work is never raised above the rest

  const auto probe = queues->spec_for(tag("", 10, TransferPurpose::kProbe), policy, 5, 0.0);
  CHECK(probe.klass == decision::TransferClass::kPrefetch);
  CHECK(probe.src_priority + probe.dst_priority + probe.route_priority == 0);

  const auto unknown = queues->spec_for(tag("no-such-route", 0), policy, 6, 0.0);
  CHECK(unknown.bytes == 1);  // an unknown size grows as the stream asks
  CHECK(unknown.klass == decision::TransferClass::kNormal);
  CHECK(unknown.src_priority + unknown.dst_priority + unknown.route_priority == 0);

  const auto critical = queues->spec_for(tag("urgent", 10), policy, 7, 0.0);
  CHECK(critical.klass == decision::TransferClass::kCritical);
  CHECK(critical.reserved_share == Approx(0.3));
  CHECK(critical.src_priority == 7);
  CHECK(critical.route_priority == 7);

  // Over max_reserved_share (0.5) a critical transfer is cut to what is left, and still goes.
  CHECK(queues->open(tag("urgent", 1 << 20)) != 0);
  CHECK(queues->open(tag("urgent", 1 << 20)) != 0);
  CHECK(queues->open(tag("urgent", 1 << 20)) != 0);
  CHECK(queues->link_stats("node-b")->queued == 3);
}

TEST_CASE("create refuses bad scheduler settings, naming the key, max_stall defaults to read_timeout / 4") {
  metrics::Registry registry;
  auto policy = std::make_shared<TestPolicy>(kPolicy);
  decision::SchedulerConfig config = small_chunks(1);
  const auto refused = LinkQueues::create(policy, config, registry);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kInvalidArgument);
  CHECK_THAT(refused.error().message, Catch::Contains("/scheduler/window_chunks"));

  metrics::Registry other;
  const auto made = LinkQueues::create(policy, small_chunks(), other);
  REQUIRE(made);
  CHECK(made.value()->config().max_stall_s == Approx(7.5));  // limits.read_timeout_ms 30000
  CHECK(made.value()->chunk_bytes() == 1024);
}

TEST_CASE("Ungated and unknown tickets are granted at once, a closed ticket's waiting request is dropped") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  auto queues = make_queues(registry, small_chunks(), std::move(options));
  TransferTag nobody = tag("bulk", 10);
  nobody.peer.clear();
  CHECK(queues->open(nobody) == 0);
  int granted = 0;
  queues->request(0, 10, [&] { ++granted; });
  queues->request(12345, 10, [&] { ++granted; });
  CHECK(granted == 2);

  const auto a = queues->open(tag("bulk", 10 * 1024));
  const auto b = queues->open(tag("bulk", 10 * 1024));
  queues->request(a, 1024, [&] { ++granted; });
  queues->request(a, 1024, [&] { ++granted; });
  CHECK(granted == 4);
  bool dropped_called = false;
  queues->request(a, 1024, [&] { dropped_called = true; });  // window full: waits
  bool b_granted = false;
  queues->request(b, 1024, [&] { b_granted = true; });
  CHECK_FALSE(b_granted);
  queues->close(a, false);  // frees the window; a's waiting request is dropped
  CHECK_FALSE(dropped_called);
  CHECK(b_granted);
  CHECK(queues->link_stats("node-b")->aborted == 1);
}

TEST_CASE("Callbacks run outside the lock, on the thread whose acknowledgement freed the window") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  auto queues = make_queues(registry, small_chunks(2), std::move(options));
  const auto a = queues->open(tag("bulk", 64 * 1024));
  const auto b = queues->open(tag("bulk", 64 * 1024));
  int a_granted = 0;
  queues->request(a, 1024, [&] { ++a_granted; });
  queues->request(a, 1024, [&] { ++a_granted; });
  REQUIRE(a_granted == 2);  // granted at once, on this thread, before request returned

  std::promise<std::thread::id> granted_on;
  std::atomic<bool> asked_again{false};
  std::thread asker([&] {
    queues->request(b, 1024, [&] {
      // Calling back into the queues from the callback: it would deadlock under the lock.
      queues->request(b, 1024, [&] { asked_again = true; });
      granted_on.set_value(std::this_thread::get_id());
    });
  });
  asker.join();  // b waits: the window is full
  std::thread::id acker_id;
  std::thread acker([&] {
    acker_id = std::this_thread::get_id();
    queues->acknowledged(a, 1024);
  });
  acker.join();
  auto future = granted_on.get_future();
  REQUIRE(future.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
  CHECK(future.get() == acker_id);
  CHECK_FALSE(asked_again);  // a and b each hold one of the two window slots
  queues->acknowledged(a, 1024);
  CHECK(asked_again);
}

TEST_CASE("A preempting transfer gets the next grant at a chunk boundary, the preempted one resumes") {
  metrics::Registry registry;
  FakeClock clock;
  broker::DecisionLog log(16);
  LinkQueuesOptions options;
  options.clock = clock.fn();
  options.decision_log = &log;
  auto queues = make_queues(registry, small_chunks(2), std::move(options));
  Senders senders(*queues);

  const auto bulk = queues->open(tag("bulk", 64 * 1024));
  senders.start(bulk, 64);
  REQUIRE(senders.grants.size() == 2);  // the window is full; bulk waits at its third chunk
  const auto urgent = queues->open(tag("urgent", 4 * 1024));
  senders.start(urgent, 4);
  REQUIRE(senders.grants.size() == 2);
  while (senders.grants.size() < 8 && senders.ack_one()) {
  }
  // Each acknowledgement freed one slot: the urgent transfer took the next four, then bulk resumed.
  const std::vector<std::uint64_t> expected{bulk, bulk, urgent, urgent, urgent, urgent, bulk, bulk};
  CHECK(senders.grants == expected);
  queues->close(urgent, true);

  const auto events = queues->events(100);
  REQUIRE(count_kind(events, LinkEventKind::kPreempted) == 1);
  REQUIRE(count_kind(events, LinkEventKind::kResumed) == 1);
  std::vector<LinkEventKind> kinds;
  for (const auto& e : events) {
    if (e.kind == LinkEventKind::kOpened) continue;
    kinds.push_back(e.kind);
    if (e.kind == LinkEventKind::kPreempted) {
      CHECK(e.transfer == bulk);
      CHECK(e.other == urgent);
      CHECK(e.route == "bulk");
      CHECK(e.purpose == TransferPurpose::kFetchReply);
    }
  }
  CHECK(kinds ==
        std::vector<LinkEventKind>{LinkEventKind::kPreempted, LinkEventKind::kResumed, LinkEventKind::kCompleted});
  const auto state = queues->state_json(10);
  CHECK(state["links"]["node-b"]["preemptions"] == 1);
  CHECK(state["links"]["node-b"]["resumes"] == 1);
  CHECK(state["links"]["node-b"]["completed"] == 1);
  CHECK(state["links"]["node-b"]["queue_depth"] == 1);
  CHECK(state["events"].back()["kind"] == "completed");
  CHECK(state["events"].back()["transfer"] == urgent);
  const auto logged = log.recent(16);
  REQUIRE(logged.size() == 1);
  CHECK(logged[0]["kind"] == "schedule");
  CHECK(logged[0]["event"] == "preempted");
  CHECK(logged[0]["by"] == urgent);
  const auto text = registry.render();
  CHECK_THAT(text, Catch::Contains("kvrelay_link_preemptions_total{peer=\"node-b\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_link_resumes_total{peer=\"node-b\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_link_queue_depth{peer=\"node-b\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_link_bytes_total{peer=\"node-b\",class=\"normal\"} 8192\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_link_wait_seconds_count{peer=\"node-b\",purpose=\"fetch_reply\"} 8\n"));
}

TEST_CASE("role_priority decides the order in which queued transfers leave") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  auto queues = make_queues(registry, small_chunks(2), std::move(options));
  Senders senders(*queues);
  senders.start(queues->open(tag("bulk", 2 * 1024)), 2);  // the link is busy
  std::map<std::uint64_t, std::string> route_of;
  // Queued in the order of their from agents' role priority, lowest first: 1, 4, 7.
  for (const std::string route : {"one-route", "mid-route", "urgent"}) {
    const auto ticket = queues->open(tag(route, 1024));
    route_of[ticket] = route;
    senders.start(ticket, 1);
  }
  REQUIRE(senders.grants.size() == 2);
  while (senders.ack_one()) {
  }
  std::vector<std::string> order;
  for (std::size_t i = 2; i < senders.grants.size(); ++i)
    order.push_back(route_of[senders.grants[i]]);
  CHECK(order == std::vector<std::string>{"urgent", "mid-route", "one-route"});
}

TEST_CASE("Pacing bounds the bytes granted per interval (counted over token refills)") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  options.pacer_thread = false;  // the test pumps
  decision::SchedulerConfig config;
  config.chunk_bytes = 64 * 1024;
  config.window_chunks = 4;
  config.link_bytes_per_s = 1024.0 * 1024.0;  // 1 MiB/s: 16 chunks a second
  auto queues = make_queues(registry, config, std::move(options));
  const auto t = queues->open(tag("bulk", 64ULL << 20));
  int ready = 0;
  const auto ask = [&] { queues->request(t, config.chunk_bytes, [&] { ++ready; }); };
  ask();
  std::vector<int> per_interval;
  int total = 0;
  for (int step = 0; step < 100; ++step) {  // 100 x 10 ms
    int granted = 0;
    while (ready > 0) {  // each grant is acknowledged at once and the next chunk asked for
      --ready;
      ++granted;
      queues->acknowledged(t, config.chunk_bytes);
      ask();
    }
    per_interval.push_back(granted);
    total += granted;
    clock.advance(std::chrono::milliseconds(10));
    queues->pump();
  }
  // Bucket of two chunks, then 1 MiB/s: about 16 chunks over the second, never a burst.
  CHECK(total >= 15);
  CHECK(total <= 2 + 16 + 1);
  CHECK(per_interval[0] == 2);  // the bucket's two chunks of burst
  for (std::size_t i = 1; i < per_interval.size(); ++i)
    CHECK(per_interval[i] <= 1);
}

TEST_CASE("The pacer thread hands out grants as tokens refill (real clock and threads)") {
  metrics::Registry registry;
  decision::SchedulerConfig config;
  config.chunk_bytes = 256 * 1024;
  config.window_chunks = 4;
  config.link_bytes_per_s = 256.0 * 1024 * 1024;  // 32 chunks in about 30 ms
  auto queues = make_queues(registry, config, LinkQueuesOptions{});
  const auto t = queues->open(tag("bulk", 32ULL * 256 * 1024));
  std::promise<int> done;
  std::thread sender([&] {
    int sent = 0;
    for (int i = 0; i < 32; ++i) {
      std::promise<void> granted;
      queues->request(t, config.chunk_bytes, [&granted] { granted.set_value(); });
      if (granted.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) break;
      ++sent;
      queues->acknowledged(t, config.chunk_bytes);
    }
    queues->close(t, sent == 32);
    done.set_value(sent);
  });
  auto result = done.get_future();
  REQUIRE(result.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  sender.join();
  CHECK(result.get() == 32);
  const auto stats = queues->link_stats("node-b");
  REQUIRE(stats);
  CHECK(stats->grants == 32);
  CHECK(stats->completed == 1);
}

TEST_CASE("A reserved route gets its share of the link, and the achieved share is measured") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  // The bulk route's weight (8) against the urgent route's (22) would give it 27% of the link.
  options.reserved_share = [](const RoutePolicy& route) { return route.id == "bulk" ? 0.45 : 0.0; };
  auto queues = make_queues(registry, small_chunks(2), std::move(options));
  Senders senders(*queues);
  const auto heavy = queues->open(tag("urgent", 10ULL << 20));
  const auto reserved = queues->open(tag("bulk", 300 * 1024));
  senders.start(heavy, 10'000);
  senders.start(reserved, 300);
  while (senders.left[reserved] > 0 && senders.ack_one())
    clock.advance(std::chrono::microseconds(100));
  const auto state = queues->state_json(0);
  const double achieved = state["links"]["node-b"]["reserved_share_achieved"];
  CHECK(achieved >= 0.45 - 0.03);
  CHECK(achieved <= 0.6);
  CHECK(state["links"]["node-b"]["bytes"]["critical"].get<std::uint64_t>() >= 299 * 1024);
}

TEST_CASE("The event ring is bounded and numbered") {
  metrics::Registry registry;
  FakeClock clock;
  LinkQueuesOptions options;
  options.clock = clock.fn();
  options.event_capacity = 8;
  auto queues = make_queues(registry, small_chunks(), std::move(options));
  for (int i = 0; i < 10; ++i) {
    const auto t = queues->open(tag("bulk", 1024, TransferPurpose::kPush));
    queues->close(t, true);
  }
  const auto events = queues->events(100);
  REQUIRE(events.size() == 8);
  for (std::size_t i = 0; i < events.size(); ++i) {
    CHECK(events[i].seq == 13 + i);  // 20 events, the oldest 12 dropped
    CHECK(events[i].kind == (i % 2 == 0 ? LinkEventKind::kOpened : LinkEventKind::kCompleted));
    CHECK(events[i].purpose == TransferPurpose::kPush);
  }
  const auto state = queues->state_json(3);
  CHECK(state["events"].size() == 3);
  CHECK(state["events_dropped"] == 12);
  CHECK(state["events"].back()["seq"] == 20);
  CHECK(state["events"].back()["kind"] == "completed");
}
