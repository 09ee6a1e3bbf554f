// UtilityLedger: the utility order the daemon's store evicts by (broker::UtilityEviction).

#include "kvrelay/decision/kv_store_policy.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

using namespace kvrelay::decision;

namespace {

std::vector<std::uint64_t> victim_keys(const UtilityLedger& ledger, std::uint64_t bytes, double now_s,
                                       const UtilityLedger::Evictable& evictable = {}) {
  std::vector<std::uint64_t> keys;
  for (const auto& victim : ledger.victims(bytes, now_s, evictable))
    keys.push_back(victim.key.low);
  return keys;
}

}  // namespace

TEST_CASE("UtilityLedger: the victim order does not change as time passes", "[decision][ledger]") {
  UtilityLedger ledger(10.0);
  ledger.track({0, 1}, 100, 0, 0.0);  // old, but hit often
  for (int i = 0; i < 6; ++i)
    REQUIRE(ledger.hit({0, 1}, 0.5));
  ledger.track({0, 2}, 100, 0, 3.0);  // newer, one hit
  ledger.track({0, 3}, 100, 2, 1.0);  // a priority-2 route's
  ledger.track({0, 4}, 100, 0, 4.0);
  const auto at_start = victim_keys(ledger, 400, 4.0);
  REQUIRE(at_start.size() == 4);
  for (const double later : {5.0, 60.0, 600.0, 6000.0}) {
    INFO(later);
    CHECK(victim_keys(ledger, 400, later) == at_start);
    // And it is the order of the utilities themselves, as the formula gives them at that time.
    for (std::size_t i = 0; i + 1 < at_start.size(); ++i) {
      CHECK(*ledger.utility({0, at_start[i]}, later) <= *ledger.utility({0, at_start[i + 1]}, later));
    }
  }
}

TEST_CASE("UtilityLedger: victims come lowest utility first, only as many as the bytes need", "[decision][ledger]") {
  UtilityLedger ledger(60.0);
  ledger.track({0, 10}, 300, 0, 0.0);
  ledger.track({0, 20}, 300, 0, 10.0);
  ledger.track({0, 30}, 300, 0, 20.0);
  ledger.track({0, 40}, 300, 5, 0.0);  // old, but its route's priority keeps it
  const auto victims = ledger.victims(500, 30.0);
  REQUIRE(victims.size() == 2);  // 600 bytes reach 500
  CHECK(victims[0].key.low == 10);
  CHECK(victims[1].key.low == 20);
  CHECK(victims[0].utility < victims[1].utility);
  CHECK(victims[0].utility == Approx(2.0 * std::exp(-30.0 / 60.0)));
  CHECK(victims[0].bytes == 300);
  CHECK(ledger.victims(0, 30.0).empty());
  CHECK(victim_keys(ledger, 1ULL << 40, 30.0) == std::vector<std::uint64_t>{10, 20, 30, 40});
  // Keys the store cannot drop (a reader holds them, another arena) are passed over.
  CHECK(victim_keys(ledger, 500, 30.0, [](const LedgerKey& key) { return key.low != 10; }) ==
        std::vector<std::uint64_t>{20, 30});
  const auto top = ledger.top(2, 30.0);
  REQUIRE(top.size() == 2);
  CHECK(top[0].key.low == 40);
  CHECK(top[1].key.low == 30);
}

TEST_CASE("UtilityLedger: equal utilities are ordered by key", "[decision][ledger]") {
  UtilityLedger ledger(60.0);
  for (const std::uint64_t key : {7ULL, 3ULL, 9ULL, 1ULL})
    ledger.track({0, key}, 10, 1, 5.0);
  ledger.track({1, 0}, 10, 1, 5.0);  // the high word orders first
  CHECK(victim_keys(ledger, 1000, 5.0) == std::vector<std::uint64_t>{1, 3, 7, 9, 0});
  CHECK(ledger.victims(1000, 5.0).back().key.high == 1);
}

TEST_CASE("UtilityLedger: a hit or a route's use moves an entry up, forget removes it", "[decision][ledger]") {
  UtilityLedger ledger(60.0);
  ledger.track({0, 1}, 100, 0, 0.0);
  ledger.track({0, 2}, 100, 0, 1.0);
  ledger.track({0, 3}, 100, 0, 2.0);
  CHECK(victim_keys(ledger, 100, 3.0) == std::vector<std::uint64_t>{1});
  REQUIRE(ledger.hit({0, 1}, 3.0));
  CHECK(ledger.find({0, 1})->hits == 2);
  CHECK(victim_keys(ledger, 100, 3.0) == std::vector<std::uint64_t>{2});
  REQUIRE(ledger.raise({0, 2}, 3, 3.0));  // no hit counted, but a priority-3 route uses it
  CHECK(ledger.find({0, 2})->hits == 1);
  CHECK(ledger.find({0, 2})->priority == 3);
  CHECK(victim_keys(ledger, 100, 3.0) == std::vector<std::uint64_t>{3});
  CHECK_FALSE(ledger.hit({0, 99}, 3.0));
  CHECK_FALSE(ledger.raise({0, 99}, 1, 3.0));
  ledger.forget({0, 3});
  CHECK(ledger.size() == 2);
  CHECK_FALSE(ledger.utility({0, 3}, 3.0));
  CHECK(victim_keys(ledger, 100, 3.0) == std::vector<std::uint64_t>{1});
  // Refiling keeps the history: one more hit, the new size.
  ledger.track({0, 1}, 250, 0, 4.0);
  CHECK(ledger.find({0, 1})->hits == 3);
  CHECK(ledger.find({0, 1})->bytes == 250);
  CHECK(ledger.size() == 2);
}

TEST_CASE("UtilityLedger: a new recency tau reorders by the new decay", "[decision][ledger]") {
  UtilityLedger ledger(1000.0);
  ledger.track({0, 1}, 100, 0, 0.0);  // four hits, long ago
  for (int i = 0; i < 3; ++i)
    REQUIRE(ledger.hit({0, 1}, 0.0));
  ledger.track({0, 2}, 100, 0, 100.0);                                      // one hit, recent
  CHECK(victim_keys(ledger, 100, 100.0) == std::vector<std::uint64_t>{2});  // slow decay: frequency wins
  ledger.set_recency_tau(10.0);
  CHECK(ledger.recency_tau() == 10.0);
  CHECK(victim_keys(ledger, 100, 100.0) == std::vector<std::uint64_t>{1});  // fast decay: recency wins
  ledger.set_recency_tau(0.0);                                              // ignored
  CHECK(ledger.recency_tau() == 10.0);
}
