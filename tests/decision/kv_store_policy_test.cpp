#include "kvrelay/decision/kv_store_policy.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <numeric>
#include <vector>

using namespace kvrelay::decision;
using kvrelay::ErrorCode;
using kvrelay::Result;
using kvrelay::Status;

namespace {

// An in-process peer store. The real one sits behind the peer plane; the policy only needs
// somewhere that keeps bytes and gives them back (or refuses to).
class MemoryPeer final : public SpillPeer {
 public:
  Status store(std::uint64_t key, std::vector<std::uint8_t> compressed) override {
    if (refuse) {
      return kvrelay::fail(ErrorCode::kResourceExhausted, "peer full");
    }
    stored_bytes += compressed.size();
    blobs[key] = std::move(compressed);
    return kvrelay::ok();
  }
  Result<std::vector<std::uint8_t>> fetch(std::uint64_t key) override {
    const auto it = blobs.find(key);
    if (it == blobs.end()) {
      return kvrelay::fail(ErrorCode::kNotFound, "not at peer");
    }
    auto bytes = std::move(it->second);
    blobs.erase(it);
    return bytes;
  }
  std::map<std::uint64_t, std::vector<std::uint8_t>> blobs;
  std::uint64_t stored_bytes = 0;
  bool refuse = false;
};

// KV-like payload: compressible but not trivial.
std::vector<std::uint8_t> payload(std::size_t size, std::uint8_t seed) {
  std::vector<std::uint8_t> bytes(size);
  for (std::size_t i = 0; i < size; ++i) {
    bytes[i] = static_cast<std::uint8_t>((i / 64) * 7 + seed);
  }
  return bytes;
}

}  // namespace

TEST_CASE("KV store keeps within its budget and evicts the lowest utility first") {
  KvStoreConfig config;
  config.budget_bytes = 4000;
  config.recency_tau_s = 10.0;
  KvStorePolicy store(config, nullptr);
  REQUIRE(store.put(1, payload(1000, 1), 0, 0.0));
  REQUIRE(store.put(2, payload(1000, 2), 5, 0.0));  // high route priority
  REQUIRE(store.put(3, payload(1000, 3), 0, 0.0));
  REQUIRE(store.put(4, payload(1000, 4), 0, 0.0));
  for (int i = 0; i < 5; ++i) {
    REQUIRE(store.get(3, 1.0));  // frequent
  }
  CHECK(store.resident_bytes() == 4000);
  // Entry 1 is old, cold and low priority; entry 4 is as cold but newer... both have one hit at t=0,
  // so recency ties; key order breaks the tie. Utility decides which go.
  CHECK(*store.utility(1, 2.0) < *store.utility(3, 2.0));
  CHECK(*store.utility(1, 2.0) < *store.utility(2, 2.0));
  REQUIRE(store.put(5, payload(1500, 5), 0, 2.0));
  CHECK(store.resident_bytes() <= 4000);
  CHECK(store.state(1) == EntryState::kAbsent);
  CHECK(store.state(4) == EntryState::kAbsent);
  CHECK(store.state(2) == EntryState::kResident);
  CHECK(store.state(3) == EntryState::kResident);
  CHECK(store.state(5) == EntryState::kResident);
  CHECK(store.stats().evictions == 2);
}

TEST_CASE("Recency decays utility") {
  KvStorePolicy store(KvStoreConfig{10'000, 5.0, 1.5, 1}, nullptr);
  REQUIRE(store.put(1, payload(100, 1), 0, 0.0));
  CHECK(*store.utility(1, 0.0) > *store.utility(1, 5.0));
  CHECK(*store.utility(1, 5.0) / *store.utility(1, 0.0) == Approx(std::exp(-1.0)));
}

TEST_CASE("Valuable entries are spilled compressed to the peer and fetched back intact on demand") {
  MemoryPeer peer;
  KvStoreConfig config;
  config.budget_bytes = 10'000;
  config.spill_min_utility = 1.5;
  KvStorePolicy store(config, &peer);
  const auto original = payload(6000, 9);
  REQUIRE(store.put(1, original, 3, 0.0));  // priority 3: utility 4 at t=0
  REQUIRE(store.put(2, payload(6000, 2), 5, 0.1));
  CHECK(store.state(1) == EntryState::kSpilled);
  CHECK(store.stats().spills == 1);
  CHECK(peer.blobs.count(1) == 1);
  CHECK(peer.stored_bytes < original.size() / 4);  // went compressed
  CHECK(store.resident_bytes() == 6000);

  const auto back = store.get(1, 1.0);
  REQUIRE(back);
  CHECK(std::vector<std::uint8_t>(back.value().begin(), back.value().end()) == original);
  CHECK(store.stats().fetches == 1);
  CHECK(store.state(1) == EntryState::kResident);
  CHECK(store.state(2) == EntryState::kSpilled);  // made room for the fetched one
  CHECK(peer.blobs.count(1) == 0);
  CHECK(store.resident_bytes() <= config.budget_bytes);
}

TEST_CASE("Low-utility entries are dropped, not spilled, and a refusing peer turns spills into evictions") {
  MemoryPeer peer;
  KvStoreConfig config;
  config.budget_bytes = 1000;
  config.spill_min_utility = 2.5;
  KvStorePolicy store(config, &peer);
  REQUIRE(store.put(1, payload(800, 1), 0, 0.0));  // one hit, priority 0: utility 2 < 2.5
  REQUIRE(store.put(2, payload(800, 2), 7, 1.0));
  CHECK(store.state(1) == EntryState::kAbsent);
  CHECK(peer.blobs.empty());
  peer.refuse = true;
  REQUIRE(store.put(3, payload(800, 3), 7, 2.0));
  CHECK(store.state(2) == EntryState::kAbsent);
  CHECK(store.stats().evictions == 2);
  CHECK(store.stats().spills == 0);
}

TEST_CASE("A stub whose peer copy is lost or corrupt reports an error and is forgotten") {
  MemoryPeer peer;
  KvStorePolicy store(KvStoreConfig{1000, 60.0, 1.0, 1}, &peer);
  REQUIRE(store.put(1, payload(800, 1), 2, 0.0));
  REQUIRE(store.put(2, payload(800, 2), 2, 0.0));
  REQUIRE(store.state(1) == EntryState::kSpilled);
  peer.blobs[1][peer.blobs[1].size() / 2] ^= 0xFF;
  peer.blobs[1].resize(peer.blobs[1].size() - 3);  // truncated frame
  const auto corrupt = store.get(1, 1.0);
  REQUIRE_FALSE(corrupt);
  CHECK(corrupt.error().code == ErrorCode::kCorrupt);
  CHECK(store.state(1) == EntryState::kAbsent);

  REQUIRE(store.put(3, payload(800, 3), 2, 2.0));
  REQUIRE(store.state(2) == EntryState::kSpilled);
  peer.blobs.erase(2);
  CHECK(store.get(2, 3.0).error().code == ErrorCode::kNotFound);
  CHECK(store.state(2) == EntryState::kAbsent);
  CHECK(store.get(42, 3.0).error().code == ErrorCode::kNotFound);
}

TEST_CASE("An entry larger than the budget is refused without evicting anything") {
  KvStorePolicy store(KvStoreConfig{1000, 60.0, 1.5, 1}, nullptr);
  REQUIRE(store.put(1, payload(600, 1), 0, 0.0));
  CHECK(store.put(2, payload(1001, 2), 7, 0.0).error().code == ErrorCode::kResourceExhausted);
  CHECK(store.state(1) == EntryState::kResident);
  CHECK(store.stats().evictions == 0);
}

TEST_CASE("Prefetch hints bring stubs back ahead of use and protect them from the next eviction") {
  MemoryPeer peer;
  KvStorePolicy store(KvStoreConfig{3000, 60.0, 1.0, 1}, &peer);
  REQUIRE(store.put(1, payload(1000, 1), 1, 0.0));
  REQUIRE(store.put(2, payload(1000, 2), 1, 1.0));
  REQUIRE(store.put(3, payload(1000, 3), 1, 2.0));
  REQUIRE(store.put(4, payload(1000, 4), 1, 3.0));
  REQUIRE(store.state(1) == EntryState::kSpilled);
  const std::uint64_t keys[] = {1};
  store.prefetch(keys, 6, 4.0);  // route A->B (priority 6) is about to need entry 1
  CHECK(store.state(1) == EntryState::kResident);
  CHECK(store.stats().fetches == 1);
  REQUIRE(store.put(5, payload(1000, 5), 1, 5.0));
  CHECK(store.state(1) == EntryState::kResident);  // the hinted entry outranks the others now
  CHECK(store.resident_bytes() <= 3000);
}

TEST_CASE("Replacing an entry keeps the accounting exact") {
  MemoryPeer peer;
  KvStorePolicy store(KvStoreConfig{2000, 60.0, 1.0, 1}, &peer);
  REQUIRE(store.put(1, payload(1000, 1), 0, 0.0));
  REQUIRE(store.put(1, payload(1500, 1), 0, 1.0));
  CHECK(store.resident_bytes() == 1500);
  REQUIRE(store.put(2, payload(1000, 2), 0, 2.0));
  REQUIRE(store.state(1) == EntryState::kSpilled);
  REQUIRE(store.put(1, payload(500, 7), 0, 3.0));  // new bytes for a spilled key
  CHECK(peer.blobs.count(1) == 0);
  CHECK(store.resident_bytes() == 1500);
  const auto got = store.get(1, 4.0);
  REQUIRE(got);
  CHECK(got.value().size() == 500);
}

// UtilityLedger: the utility order the store and KvStorePolicy evict by.

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
