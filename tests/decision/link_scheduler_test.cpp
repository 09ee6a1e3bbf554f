#include "kvrelay/decision/link_scheduler.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <random>
#include <vector>

using namespace kvrelay::decision;
using kvrelay::ErrorCode;

namespace {

TransferSpec spec(std::uint64_t id, std::uint64_t bytes, int src = 0, int dst = 0, int route = 0) {
  TransferSpec out;
  out.id = id;
  out.bytes = bytes;
  out.src_priority = src;
  out.dst_priority = dst;
  out.route_priority = route;
  return out;
}

TransferSpec critical(std::uint64_t id, std::uint64_t bytes, double share) {
  TransferSpec out = spec(id, bytes);
  out.klass = TransferClass::kCritical;
  out.reserved_share = share;
  return out;
}

TransferSpec prefetch(std::uint64_t id, std::uint64_t bytes) {
  TransferSpec out = spec(id, bytes);
  out.klass = TransferClass::kPrefetch;
  return out;
}

// A virtual link of 1 MB/s in 1000-byte chunks: one chunk per millisecond.
SchedulerConfig millisecond_chunks() {
  SchedulerConfig config;
  config.link_bytes_per_s = 1e6;
  config.chunk_bytes = 1000;
  return config;
}

struct Progress {
  std::uint64_t next_offset = 0;
  bool completed = false;
  double first_service_s = -1.0;
  double completed_s = -1.0;
};

// Checks every chunk against the transfer's running offset: chunks of one transfer must be
// contiguous, never repeated or skipped, whatever interleaving or preemption happened.
void account(std::map<std::uint64_t, Progress>& progress, const ChunkEvent& event) {
  Progress& p = progress[event.transfer];
  REQUIRE_FALSE(p.completed);
  REQUIRE(event.offset == p.next_offset);
  if (p.first_service_s < 0) {
    p.first_service_s = event.start_s;
  }
  p.next_offset += event.bytes;
  if (event.completed) {
    p.completed = true;
    p.completed_s = event.end_s;
  }
}

std::vector<std::uint64_t> completion_order(LinkScheduler& scheduler) {
  std::vector<std::uint64_t> order;
  while (auto event = scheduler.step()) {
    if (event->completed) order.push_back(event->transfer);
  }
  return order;
}

std::size_t count_events(const std::vector<SchedulerEvent>& events, SchedulerEventKind kind) {
  std::size_t n = 0;
  for (const auto& e : events)
    n += e.kind == kind ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("Scheduler sends every byte of every transfer exactly once, in order") {
  LinkScheduler scheduler(millisecond_chunks());
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint64_t> size(1, 20'000);
  std::uniform_int_distribution<int> prio(0, 7);
  std::map<std::uint64_t, std::uint64_t> sizes;
  for (std::uint64_t id = 1; id <= 50; ++id) {
    sizes[id] = size(rng);
    REQUIRE(scheduler.submit(spec(id, sizes[id], prio(rng), prio(rng), prio(rng)), scheduler.now()));
  }
  std::map<std::uint64_t, Progress> progress;
  std::uint64_t total = 0;
  while (auto event = scheduler.step()) {
    account(progress, *event);
    total += event->bytes;
  }
  std::uint64_t expected = 0;
  for (const auto& [id, bytes] : sizes) {
    CHECK(progress[id].completed);
    CHECK(progress[id].next_offset == bytes);
    expected += bytes;
  }
  CHECK(total == expected);
  CHECK(scheduler.now() == Approx(static_cast<double>(expected) / 1e6));  // the link never idles
  CHECK(scheduler.stats().completed == 50);
}

TEST_CASE("Submission errors") {
  LinkScheduler scheduler(SchedulerConfig{});
  CHECK(scheduler.submit(spec(1, 0), 0.0).error().code == ErrorCode::kInvalidArgument);
  REQUIRE(scheduler.submit(critical(1, 10, 0.5), 0.0));
  CHECK(scheduler.submit(spec(1, 10), 0.0).error().code == ErrorCode::kAlreadyExists);
  CHECK(scheduler.submit(critical(2, 10, 0.5), 0.0).error().code == ErrorCode::kResourceExhausted);
  CHECK(scheduler.submit(critical(3, 10, 1.5), 0.0).error().code == ErrorCode::kInvalidArgument);
  TransferSpec normal_with_share = spec(4, 10);
  normal_with_share.reserved_share = 0.1;
  CHECK(scheduler.submit(normal_with_share, 0.0).error().code == ErrorCode::kInvalidArgument);
  TransferSpec bad_deadline = spec(5, 10);
  bad_deadline.deadline_s = std::nan("");
  CHECK(scheduler.submit(bad_deadline, 0.0).error().code == ErrorCode::kInvalidArgument);
  CHECK(scheduler.queued() == 1);
}

TEST_CASE("max_reserved_share caps the sum of reservations, and never above 0.9") {
  SchedulerConfig config;
  config.max_reserved_share = 0.3;
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(critical(1, 10, 0.2), 0.0));
  CHECK(scheduler.reserved_left() == Approx(0.1));
  CHECK(scheduler.submit(critical(2, 10, 0.2), 0.0).error().code == ErrorCode::kResourceExhausted);
  REQUIRE(scheduler.submit(critical(3, 10, 0.1), 0.0));
  CHECK(scheduler.reserved_left() == Approx(0.0).margin(1e-12));
  // A finished reservation frees its share.
  REQUIRE(scheduler.finish(1, true));
  CHECK(scheduler.reserved_left() == Approx(0.2));
  REQUIRE(scheduler.submit(critical(2, 10, 0.2), 0.0));

  config.max_reserved_share = 0.95;  // above the hard cap
  LinkScheduler capped(config);
  CHECK(capped.config().max_reserved_share == Approx(kMaxReservedShare));
  REQUIRE(capped.submit(critical(1, 10, 0.85), 0.0));
  CHECK(capped.submit(critical(2, 10, 0.1), 0.0).error().code == ErrorCode::kResourceExhausted);
  REQUIRE(capped.submit(critical(3, 10, 0.05), 0.0));
}

TEST_CASE("validate names the policy key of each bad setting") {
  CHECK(validate(SchedulerConfig{}));
  SchedulerConfig bad;
  bad.time_slice_s = 0.001;
  bad.window_chunks = 1;
  bad.max_reserved_share = 0.95;
  bad.preempt_max_done = 1.5;
  const auto status = validate(bad);
  REQUIRE_FALSE(status);
  CHECK(status.error().code == ErrorCode::kInvalidArgument);
  const std::string& message = status.error().message;
  CHECK(message.find("/scheduler/time_slice_ms") != std::string::npos);
  CHECK(message.find("/scheduler/window_chunks") != std::string::npos);
  CHECK(message.find("/scheduler/max_reserved_share") != std::string::npos);
  CHECK(message.find("/scheduler/preempt_max_done") != std::string::npos);
  CHECK(message.find("/scheduler/chunk_bytes") == std::string::npos);
}

TEST_CASE("No starvation: a low-priority transfer is served within a bounded wait under sustained high-priority load") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.004;  // 4 chunks
  config.beta = 20.0;
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 20'000), 0.0));
  // Eight priority-7 flows, each replaced as soon as it finishes: the link is always offered
  // more high-priority work than it can carry.
  std::uint64_t next_id = 100;
  for (int i = 0; i < 8; ++i) {
    REQUIRE(scheduler.submit(spec(next_id++, 10'000, 7, 7, 7), 0.0));
  }
  std::map<std::uint64_t, Progress> progress;
  std::uint64_t high_completed = 0;
  while (!progress[1].completed && scheduler.now() < 60.0) {
    const auto event = scheduler.step();
    REQUIRE(event);
    account(progress, *event);
    if (event->completed && event->transfer != 1) {
      ++high_completed;
      REQUIRE(scheduler.submit(spec(next_id++, 10'000, 7, 7, 7), scheduler.now()));
    }
  }
  REQUIRE(progress[1].completed);
  // The low flow's weight 1 + exp(beta * d) must reach the high flows' total weight 8 * (22 + e^x)
  // for some bounded delay; with their own weights kept fresh by service, the bound below is
  // generous (delay where exp(beta*d) exceeds 8 * (22 + e^(beta * 8 slices)) plus a few rounds).
  const double slice_s = config.time_slice_s;
  const double fresh_high = 22.0 + std::exp(config.beta * 8 * slice_s);
  const double bound = std::log(8 * fresh_high) / config.beta + 16 * slice_s;
  CHECK(progress[1].first_service_s <= bound);
  CHECK(progress[1].completed_s <= bound + 20 * 9 * slice_s);
  CHECK(high_completed >= 8);  // by count: the high load kept coming (each flow replaced at least once)
}

TEST_CASE("Preemption at a chunk boundary, and the preempted transfer resumes where it stopped") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 1.0;  // without preemption the running transfer would keep the link
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 100'000), 0.0));
  std::map<std::uint64_t, Progress> progress;
  for (int i = 0; i < 10; ++i) {
    account(progress, *scheduler.step());
  }
  REQUIRE(progress[1].next_offset == 10'000);
  // Weight 7 + 7 + 1 + 1 = 16 vs the running one's 2: more than twice, and it is 10% done.
  REQUIRE(scheduler.submit(spec(2, 5'000, 7, 7), scheduler.now()));
  const auto next = scheduler.step();
  REQUIRE(next);
  CHECK(next->transfer == 2);
  CHECK(next->preempting);
  CHECK(scheduler.preemptions() == 1);
  account(progress, *next);
  while (auto event = scheduler.step()) {
    account(progress, *event);
  }
  CHECK(progress[2].completed);
  CHECK(progress[1].completed);
  CHECK(progress[1].next_offset == 100'000);
  CHECK(progress[2].completed_s < progress[1].completed_s);
  const auto events = scheduler.drain_events();
  REQUIRE(count_events(events, SchedulerEventKind::kPreempted) == 1);
  CHECK(count_events(events, SchedulerEventKind::kResumed) == 1);
  CHECK(events.front().transfer == 1);
  CHECK(events.front().other == 2);
  CHECK(scheduler.stats().resumes == 1);
  CHECK(scheduler.drain_events().empty());
}

TEST_CASE("Preemption only below preempt_max_done (0.4) and above the weight factor") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 1.0;
  REQUIRE(config.preempt_max_done == Approx(0.4));  // the default
  const auto preempted_at = [&](int chunks_done, int src, int dst, int new_src, int new_dst) {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(1, 10'000, src, dst), 0.0));
    for (int i = 0; i < chunks_done; ++i) {
      REQUIRE(scheduler.step()->transfer == 1);
    }
    REQUIRE(scheduler.submit(spec(2, 5'000, new_src, new_dst), scheduler.now()));
    const auto next = scheduler.step();
    REQUIRE(next);
    return next->transfer == 2 && scheduler.preemptions() == 1;
  };
  CHECK(preempted_at(3, 0, 0, 7, 7));        // 30% done
  CHECK_FALSE(preempted_at(4, 0, 0, 7, 7));  // 40% done: not below the threshold
  CHECK_FALSE(preempted_at(6, 0, 0, 7, 7));  // 60% done
  CHECK_FALSE(preempted_at(1, 3, 3, 4, 4));  // 10 vs 8: below the factor of 2
}

TEST_CASE("Reservations: a critical flow gets its share of the link against higher-priority load") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.002;
  LinkScheduler scheduler(config);
  for (std::uint64_t id = 10; id < 16; ++id) {
    REQUIRE(scheduler.submit(spec(id, 10'000'000, 7, 7, 7), 0.0));
  }
  for (int i = 0; i < 100; ++i) {
    (void)scheduler.step();
  }
  const double share = 0.3;
  REQUIRE(scheduler.submit(critical(1, 300'000, share), scheduler.now()));
  std::uint64_t link_bytes = 0;
  std::uint64_t critical_bytes = 0;
  bool done = false;
  while (!done) {
    const auto event = scheduler.step();
    REQUIRE(event);
    link_bytes += event->bytes;
    if (event->transfer == 1) {
      critical_bytes += event->bytes;
      done = event->completed;
    }
    // At every point the critical flow is at most one chunk behind its reservation.
    CHECK(static_cast<double>(critical_bytes) + 1000.0 >= share * static_cast<double>(link_bytes));
  }
  CHECK(static_cast<double>(critical_bytes) / static_cast<double>(link_bytes) == Approx(share).margin(0.01));
  const auto stats = scheduler.stats();
  CHECK(stats.reserved_bytes == 300'000);
  CHECK(static_cast<double>(stats.reserved_bytes) / static_cast<double>(stats.bytes_while_reserved) ==
        Approx(share).margin(0.01));
  CHECK(stats.bytes_by_class[static_cast<std::size_t>(TransferClass::kCritical)] == 300'000);
}

TEST_CASE("Weighted round robin shares the link in proportion to priority") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.001;
  config.alpha = 0.0;  // pure role priority, to check the proportions
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 1'000'000, 1, 0), 0.0));     // weight 2
  REQUIRE(scheduler.submit(spec(2, 1'000'000, 3, 1, 1), 0.0));  // weight 6
  std::map<std::uint64_t, std::uint64_t> bytes;
  for (int i = 0; i < 800; ++i) {
    const auto event = scheduler.step();
    bytes[event->transfer] += event->bytes;
  }
  CHECK(static_cast<double>(bytes[2]) / static_cast<double>(bytes[1]) == Approx(3.0).epsilon(0.02));
}

TEST_CASE("Role priority and route priority decide the order queued transfers leave in") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.002;
  SECTION("role priority of the source agent") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(1, 20'000, 1, 0), 0.0));
    REQUIRE(scheduler.submit(spec(4, 20'000, 4, 0), 0.0));
    REQUIRE(scheduler.submit(spec(7, 20'000, 7, 0), 0.0));
    CHECK(completion_order(scheduler) == std::vector<std::uint64_t>{7, 4, 1});
  }
  SECTION("role priority of the destination agent") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(1, 20'000, 0, 1), 0.0));
    REQUIRE(scheduler.submit(spec(7, 20'000, 0, 7), 0.0));
    REQUIRE(scheduler.submit(spec(4, 20'000, 0, 4), 0.0));
    CHECK(completion_order(scheduler) == std::vector<std::uint64_t>{7, 4, 1});
  }
  SECTION("route priority") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(4, 20'000, 2, 2, 4), 0.0));
    REQUIRE(scheduler.submit(spec(1, 20'000, 2, 2, 1), 0.0));
    REQUIRE(scheduler.submit(spec(7, 20'000, 2, 2, 7), 0.0));
    CHECK(completion_order(scheduler) == std::vector<std::uint64_t>{7, 4, 1});
  }
}

TEST_CASE("A transfer that would miss its deadline at its share is raised, earliest deadline first, for good") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 1.0;
  LinkScheduler scheduler(config);
  // Weight 23 against 2: the bulk transfer has ~92% of the link.
  REQUIRE(scheduler.submit(spec(1, 1'000'000, 7, 7, 7), 0.0));
  TransferSpec relaxed = spec(2, 5'000);
  relaxed.deadline_s = 100.0;  // 5 KB at 8% of 1 MB/s: 0.06 s, well within
  REQUIRE(scheduler.submit(relaxed, 0.0));
  TransferSpec late = spec(3, 20'000);
  late.deadline_s = 0.2;  // 20 KB at 8%: 0.25 s
  REQUIRE(scheduler.submit(late, 0.0));
  TransferSpec later = spec(4, 10'000);
  later.deadline_s = 0.12;  // 10 KB at 7%: 0.145 s; submitted after, earlier deadline: goes first
  REQUIRE(scheduler.submit(later, 0.0));
  auto events = scheduler.drain_events();
  REQUIRE(count_events(events, SchedulerEventKind::kDeadlineRaised) == 2);
  CHECK(events[0].transfer == 3);
  CHECK(events[1].transfer == 4);

  std::vector<std::uint64_t> order;
  std::map<std::uint64_t, Progress> progress;
  while (!progress[3].completed) {
    const auto event = scheduler.step();
    REQUIRE(event);
    account(progress, *event);
    order.push_back(event->transfer);
  }
  // EDF: all of 4, then all of 3, before anyone else; both finished before their deadlines.
  REQUIRE(order.size() == 30);
  for (std::size_t i = 0; i < order.size(); ++i) {
    CHECK(order[i] == (i < 10 ? 4U : 3U));
  }
  CHECK(progress[4].completed_s <= 0.12);
  CHECK(progress[3].completed_s <= 0.2);
  CHECK(scheduler.stats().deadline_raises == 2);

  // Sticky: once raised, a transfer keeps the top class even when it would now make it easily.
  LinkScheduler sticky(config);
  REQUIRE(sticky.submit(spec(2, 1'000'000, 7, 7, 7), 0.0));
  TransferSpec urgent = spec(1, 20'000);
  urgent.deadline_s = 0.2;  // 20 KB at 8%: 0.25 s
  REQUIRE(sticky.submit(urgent, 0.0));
  REQUIRE(sticky.finish(2, false));  // alone, it would now need 0.02 s
  REQUIRE(sticky.submit(spec(3, 10'000, 7, 7, 7), 0.0));
  for (int i = 0; i < 3; ++i) {
    sticky.set_waiting(3, true, 0.0);
    sticky.set_waiting(1, true, 0.0);
    const auto g = sticky.grant(0.0);
    REQUIRE(g);
    CHECK(g->id == 1);
    CHECK(g->reason == GrantReason::kDeadline);
    CHECK(g->raised);
    sticky.acknowledged(g->id, g->bytes);
  }
  CHECK(count_events(sticky.drain_events(), SchedulerEventKind::kDeadlineRaised) == 1);
}

TEST_CASE("Prefetch goes only when nothing else asks, and anything preempts it at any progress") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 1.0;
  SECTION("queued together, the normal transfer goes first whatever its priority") {
    LinkScheduler scheduler(config);
    TransferSpec ahead = prefetch(1, 10'000);
    ahead.src_priority = 7;
    ahead.dst_priority = 7;
    REQUIRE(scheduler.submit(ahead, 0.0));
    REQUIRE(scheduler.submit(spec(2, 10'000), 0.0));
    std::vector<std::uint64_t> order;
    while (auto event = scheduler.step())
      order.push_back(event->transfer);
    REQUIRE(order.size() == 20);
    for (std::size_t i = 0; i < order.size(); ++i)
      CHECK(order[i] == (i < 10 ? 2U : 1U));
    CHECK(scheduler.stats().bytes_by_class[static_cast<std::size_t>(TransferClass::kPrefetch)] == 10'000);
  }
  SECTION("90% done, a prefetch still yields to a priority-0 transfer, then resumes") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(prefetch(1, 10'000), 0.0));
    std::map<std::uint64_t, Progress> progress;
    for (int i = 0; i < 9; ++i) {
      const auto event = scheduler.step();
      REQUIRE(event->transfer == 1);
      account(progress, *event);
    }
    REQUIRE(scheduler.submit(spec(2, 3'000), scheduler.now()));
    for (int i = 0; i < 3; ++i) {
      const auto event = scheduler.step();
      REQUIRE(event->transfer == 2);
      CHECK(event->preempting == (i == 0));
      account(progress, *event);
    }
    const auto last = scheduler.step();
    REQUIRE(last);
    account(progress, *last);
    CHECK(last->transfer == 1);
    CHECK(last->offset == 9'000);
    CHECK(last->completed);
    const auto events = scheduler.drain_events();
    REQUIRE(count_events(events, SchedulerEventKind::kPreempted) == 1);
    CHECK(events[0].transfer == 1);
    CHECK(events[0].other == 2);
    CHECK(count_events(events, SchedulerEventKind::kResumed) == 1);
  }
}

TEST_CASE("The window: never more than window_chunks granted and unacknowledged on the link") {
  SchedulerConfig config = millisecond_chunks();
  config.window_chunks = 4;
  LinkScheduler scheduler(config);
  std::mt19937 rng(11);
  std::map<std::uint64_t, std::uint64_t> unacked;  // per transfer: granted, not acknowledged
  std::map<std::uint64_t, std::uint64_t> next_offset;
  std::map<std::uint64_t, std::uint64_t> sizes;
  for (std::uint64_t id = 1; id <= 6; ++id) {
    sizes[id] = 5'000 + 1'000 * id;
    REQUIRE(scheduler.submit(spec(id, sizes[id], static_cast<int>(id), 0), 0.0));
    scheduler.set_waiting(id, true, 0.0);
  }
  double now = 0.0;
  std::size_t full_refusals = 0;
  std::size_t finished = 0;
  while (finished < sizes.size()) {
    now += 0.0005;
    // Grant until refused; everyone who was granted asks again at once.
    while (const auto g = scheduler.grant(now)) {
      CHECK(g->offset == next_offset[g->id]);
      next_offset[g->id] += g->bytes;
      unacked[g->id] += g->bytes;
      std::uint64_t total = 0;
      for (const auto& [id, bytes] : unacked)
        total += bytes;
      REQUIRE(scheduler.stats().inflight_chunks <= config.window_chunks);
      CHECK(scheduler.stats().inflight_bytes == total);
      if (!g->last) scheduler.set_waiting(g->id, true, now);
    }
    if (scheduler.stats().inflight_chunks == config.window_chunks) ++full_refusals;
    // Acknowledge a random transfer's chunks, sometimes in part.
    std::vector<std::uint64_t> pending;
    for (const auto& [id, bytes] : unacked) {
      if (bytes > 0) pending.push_back(id);
    }
    if (pending.empty()) continue;
    const std::uint64_t id = pending[rng() % pending.size()];
    const std::uint64_t ack = (rng() % 2 == 0) ? unacked[id] : std::min<std::uint64_t>(unacked[id], 700);
    scheduler.acknowledged(id, ack);
    unacked[id] -= ack;
    if (unacked[id] == 0 && next_offset[id] == sizes[id]) {
      REQUIRE(scheduler.finish(id, true));
      unacked.erase(id);
      ++finished;
    }
  }
  CHECK(full_refusals > 0);  // the window did bind
  CHECK(scheduler.stats().completed == 6);
  CHECK(scheduler.stats().inflight_chunks == 0);
  CHECK(scheduler.stats().link_bytes == 5'000 * 6 + 1'000 * 21);
}

TEST_CASE("finish releases the window, aborted transfers are counted, unknown ids are refused") {
  SchedulerConfig config = millisecond_chunks();
  config.window_chunks = 2;
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 10'000), 0.0));
  REQUIRE(scheduler.submit(spec(2, 10'000), 0.0));
  scheduler.set_waiting(1, true, 0.0);
  REQUIRE(scheduler.grant(0.0));
  scheduler.set_waiting(1, true, 0.0);
  REQUIRE(scheduler.grant(0.0));
  scheduler.set_waiting(2, true, 0.0);
  CHECK_FALSE(scheduler.grant(0.0));  // window full
  REQUIRE(scheduler.finish(1, false));
  const auto g = scheduler.grant(0.0);
  REQUIRE(g);
  CHECK(g->id == 2);
  CHECK(scheduler.stats().aborted == 1);
  CHECK(scheduler.finish(1, true).error().code == ErrorCode::kNotFound);
  scheduler.acknowledged(99, 1000);           // ignored
  scheduler.set_waiting(99, true, 0.0, 100);  // ignored
  CHECK(scheduler.stats().inflight_chunks == 1);
}

TEST_CASE("A transfer that asks past its estimated size grows, want_bytes sizes its chunks") {
  LinkScheduler scheduler(millisecond_chunks());
  REQUIRE(scheduler.submit(spec(1, 1'500), 0.0));
  scheduler.set_waiting(1, true, 0.0);
  auto g = scheduler.grant(0.0);
  REQUIRE(g);
  CHECK(g->bytes == 1'000);
  CHECK_FALSE(g->last);
  scheduler.set_waiting(1, true, 0.0, 1'000);  // the estimate was short by 500
  g = scheduler.grant(0.0);
  REQUIRE(g);
  CHECK(g->offset == 1'000);
  CHECK(g->bytes == 1'000);
  CHECK(g->last);
  scheduler.set_waiting(1, true, 0.0);  // nothing left and no size asked: not granted
  CHECK_FALSE(scheduler.grant(0.0));
  scheduler.set_waiting(1, true, 0.0, 300);
  g = scheduler.grant(0.0);
  REQUIRE(g);
  CHECK(g->offset == 2'000);
  CHECK(g->bytes == 300);
}

TEST_CASE("A running transfer that is not asking lends the link without losing its slice") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.005;
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 100'000, 7, 7), 0.0));
  REQUIRE(scheduler.submit(spec(2, 100'000, 0, 0), 0.0));
  scheduler.set_waiting(1, true, 0.0);
  scheduler.set_waiting(2, true, 0.0);
  auto g = scheduler.grant(0.0);
  REQUIRE(g);
  REQUIRE(g->id == 1);
  scheduler.acknowledged(1, g->bytes);
  g = scheduler.grant(0.001);  // 1 has not asked again yet: 2 sends this chunk
  REQUIRE(g);
  CHECK(g->id == 2);
  scheduler.acknowledged(2, g->bytes);
  scheduler.set_waiting(1, true, 0.002);
  scheduler.set_waiting(2, true, 0.002);
  g = scheduler.grant(0.002);
  REQUIRE(g);
  CHECK(g->id == 1);
  CHECK(g->reason == GrantReason::kRunning);
  CHECK(scheduler.preemptions() == 0);
}

TEST_CASE("The stall guard gives the link to a transfer that has waited max_stall_s") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 10.0;
  config.max_stall_s = 0.0495;
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 1'000'000, 7, 7, 7), 0.0));
  REQUIRE(scheduler.submit(spec(2, 10'000), 0.0));
  scheduler.set_waiting(2, true, 0.0);
  double now = 0.0;
  int step = 0;
  int high_grants = 0;
  std::optional<Grant> low;
  while (!low && now < 1.0) {
    scheduler.set_waiting(1, true, now);
    const auto g = scheduler.grant(now);
    REQUIRE(g);
    scheduler.acknowledged(g->id, g->bytes);
    if (g->id == 2) {
      low = g;
    } else {
      ++high_grants;
      scheduler.set_waiting(1, false, now);
    }
    now = 0.001 * ++step;
  }
  REQUIRE(low);
  CHECK(low->reason == GrantReason::kStallGuard);
  CHECK(low->waited_s >= 0.0495);
  CHECK(high_grants == 50);  // at t = 0 .. 49 ms the high one sent; at 50 ms the guard fired
  const auto events = scheduler.drain_events();
  REQUIRE(count_events(events, SchedulerEventKind::kStallGuard) == 1);
  CHECK(scheduler.stats().stall_guards == 1);
}

TEST_CASE("FIFO mode: submit order, one transfer to completion, whatever the priorities") {
  SchedulerConfig config = millisecond_chunks();
  config.mode = SchedulerMode::kFifo;
  SECTION("simulated") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(1, 5'000, 0, 0), 0.0));
    REQUIRE(scheduler.submit(spec(2, 5'000, 7, 7, 7), 0.0));
    REQUIRE(scheduler.submit(critical(3, 5'000, 0.5), 0.0));
    std::vector<std::uint64_t> order;
    while (auto event = scheduler.step())
      order.push_back(event->transfer);
    REQUIRE(order.size() == 15);
    for (std::size_t i = 0; i < order.size(); ++i)
      CHECK(order[i] == i / 5 + 1);
    CHECK(scheduler.preemptions() == 0);
  }
  SECTION("the head not asking holds the link") {
    LinkScheduler scheduler(config);
    REQUIRE(scheduler.submit(spec(1, 5'000), 0.0));
    REQUIRE(scheduler.submit(spec(2, 5'000, 7, 7, 7), 0.0));
    scheduler.set_waiting(2, true, 0.0);
    CHECK_FALSE(scheduler.grant(0.0));
    scheduler.set_waiting(1, true, 0.0);
    const auto g = scheduler.grant(0.0);
    REQUIRE(g);
    CHECK(g->id == 1);
    CHECK(g->reason == GrantReason::kFifo);
  }
}

TEST_CASE("Preempted transfers resume at their next offset: no offset granted twice (windowed, acked)") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.020;
  config.window_chunks = 3;
  LinkScheduler scheduler(config);
  std::mt19937 rng(3);
  std::map<std::uint64_t, std::uint64_t> sizes;
  std::map<std::uint64_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>> granted;  // offset, bytes
  std::map<std::uint64_t, std::uint64_t> acked;
  std::map<std::uint64_t, std::uint64_t> sent;
  double now = 0.0;
  std::uint64_t next_id = 1;
  const auto add = [&](std::uint64_t bytes, int prio) {
    const std::uint64_t id = next_id++;
    sizes[id] = bytes;
    REQUIRE(scheduler.submit(spec(id, bytes, prio, prio), now));
    scheduler.set_waiting(id, true, now);
  };
  add(600'000, 0);  // bulk
  std::size_t finished = 0;
  for (int round = 0; finished < sizes.size() && round < 100'000; ++round) {
    now += 0.001;
    if (round % 15 == 5 && next_id < 20) add(4'000 + (rng() % 4) * 1'000, 7);  // urgent arrivals
    while (const auto g = scheduler.grant(now)) {
      granted[g->id].emplace_back(g->offset, g->bytes);
      CHECK(g->offset == sent[g->id]);
      sent[g->id] += g->bytes;
      if (!g->last) scheduler.set_waiting(g->id, true, now);
    }
    // Acknowledge everything sent so far (one round trip of 1 ms).
    for (auto& [id, bytes] : sent) {
      if (sizes.count(id) == 0 || acked[id] == bytes) continue;
      scheduler.acknowledged(id, bytes - acked[id]);
      acked[id] = bytes;
      if (bytes == sizes[id]) {
        REQUIRE(scheduler.finish(id, true));
        ++finished;
      }
    }
  }
  REQUIRE(finished == sizes.size());
  for (const auto& [id, chunks] : granted) {
    std::uint64_t expect = 0;
    for (const auto& [offset, bytes] : chunks) {
      CHECK(offset == expect);  // contiguous: never repeated, never skipped
      expect += bytes;
    }
    CHECK(expect == sizes[id]);
  }
  const auto stats = scheduler.stats();
  CHECK(stats.preemptions >= 1);
  CHECK(stats.resumes == stats.preemptions);  // every preempted transfer came back
  CHECK(stats.completed == sizes.size());
}

TEST_CASE("A running transfer whose slice has run out is still preempted, and resumes, by a much heavier one") {
  SchedulerConfig config = millisecond_chunks();
  config.time_slice_s = 0.002;  // two chunks: the slice has run out when the heavy one arrives
  LinkScheduler scheduler(config);
  REQUIRE(scheduler.submit(spec(1, 100'000), 0.0));
  std::map<std::uint64_t, Progress> progress;
  for (int i = 0; i < 5; ++i) {
    account(progress, *scheduler.step());
  }
  REQUIRE(scheduler.submit(spec(2, 5'000, 7, 7), scheduler.now()));
  const auto next = scheduler.step();
  REQUIRE(next);
  CHECK(next->transfer == 2);
  CHECK(next->preempting);
  account(progress, *next);
  while (auto event = scheduler.step()) {
    account(progress, *event);
  }
  CHECK(progress[1].next_offset == 100'000);
  CHECK(progress[2].completed_s < progress[1].completed_s);
  const auto events = scheduler.drain_events();
  CHECK(count_events(events, SchedulerEventKind::kPreempted) == 1);
  CHECK(count_events(events, SchedulerEventKind::kResumed) == 1);
  // A heavier transfer not past the factor only shares the link by weight: no preemption.
  LinkScheduler shared(config);
  REQUIRE(shared.submit(spec(3, 100'000, 3, 3), 0.0));
  for (int i = 0; i < 5; ++i)
    REQUIRE(shared.step()->transfer == 3);
  REQUIRE(shared.submit(spec(4, 5'000, 4, 4), shared.now()));
  while (shared.step()) {
  }
  CHECK(shared.preemptions() == 0);
}
