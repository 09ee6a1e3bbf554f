// The store's eviction policies: LRU (the default, unchanged) and the daemon's utility order
// (broker::UtilityEviction over decision::UtilityLedger), on a clock the test sets.

#include "kvrelay/kv_store/eviction.h"

#include <catch2/catch.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "kvrelay/broker/utility_eviction.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_store.h"

using namespace kvrelay;
using namespace kvrelay::kv_store;

namespace {

constexpr std::uint64_t kEvictModel = 11;
constexpr std::uint32_t kEvictBlockTokens = 16;
// 16 fp32 tokens of 1 layer, 1 head of 4: K and V, 512 bytes.
constexpr std::uint64_t kEvictEntryBytes = 2 * kEvictBlockTokens * 4 * sizeof(float);

struct TestClock {
  double now = 0.0;
  double tau = 60.0;
};

std::unique_ptr<broker::UtilityEviction> utility_on(TestClock& clock) {
  return std::make_unique<broker::UtilityEviction>([&clock] { return clock.tau; }, [&clock] { return clock.now; });
}

std::shared_ptr<const StoredEntry> evict_entry(std::uint64_t tokens, ShmArena* arena = nullptr) {
  const KvLayout layout{1, 1, 4, DType::kFloat32, tokens};
  const std::vector<std::byte> kv(layout.total_bytes().value(), std::byte{3});
  auto made = make_stored_entry(layout, kv, arena);
  REQUIRE(made);
  return made.value();
}

EntryKey key_of(std::uint64_t hash) {
  return {kEvictModel, hash};
}

void put(EntryStore& store, std::uint64_t hash, ShmArena* arena = nullptr) {
  REQUIRE(store.put(key_of(hash), evict_entry(kEvictBlockTokens, arena)));
}

// `blocks` blocks of token ids, different per seed.
EntryChain evict_chain(std::size_t blocks, std::uint32_t seed) {
  EntryChain chain;
  chain.block_tokens = kEvictBlockTokens;
  for (std::size_t token = 0; token < blocks * kEvictBlockTokens; ++token)
    chain.tokens.push_back(static_cast<TokenId>(token * 13 + seed * 1000 + 1));
  return chain;
}

// Filed under its last block's key, so its other blocks are in the prefix index.
std::vector<std::uint64_t> put_chained_entry(EntryStore& store, const EntryChain& chain) {
  const KvLayout layout{1, 1, 4, DType::kFloat32, chain.tokens.size()};
  auto made = make_stored_entry(layout, std::vector<std::byte>(layout.total_bytes().value(), std::byte{4}));
  REQUIRE(made);
  made.value()->chain = std::make_shared<const EntryChain>(chain);
  const auto keys = chain_keys(kEvictModel, chain, ChainScope::kUnscoped);
  REQUIRE(store.put(key_of(keys.back()), made.value()));
  return keys;
}

bool held(EntryStore& store, std::uint64_t hash) {
  return store.get(key_of(hash)) != nullptr;
}

}  // namespace

TEST_CASE("eviction: the default stays least recently used", "[kv_store][eviction]") {
  InMemoryEntryStore store(3 * kEvictEntryBytes);
  put(store, 1);
  put(store, 2);
  put(store, 3);
  REQUIRE(store.get(key_of(1)));  // 2 is now the least recently used
  put(store, 4);
  const auto stats = store.stats();
  CHECK(stats.eviction_policy == "lru");
  CHECK(stats.budget == 3 * kEvictEntryBytes);
  CHECK(stats.budget_evictions == 1);
  CHECK(stats.evictions == 1);
  CHECK(stats.entries == 3);
  CHECK(stats.bytes == 3 * kEvictEntryBytes);
  CHECK_FALSE(held(store, 2));
  CHECK(held(store, 1));
  CHECK(held(store, 3));
  CHECK(held(store, 4));
  // LRU lists the most recently used first, without a utility.
  const auto top = store.top(10);
  REQUIRE(top.size() == 3);
  CHECK(top[0].key == key_of(4));  // the gets above: 1, 3, then 4 last
  CHECK_FALSE(top[0].utility);
  CHECK(top[0].bytes == kEvictEntryBytes);
}

TEST_CASE("eviction by utility: an often-hit older entry outlives a recent one never hit, unlike LRU",
          "[kv_store][eviction]") {
  // The same history through both stores: entry 1 filed first and looked up often, entry 2 filed
  // later and never looked up, then entry 3 needs the room of one.
  TestClock clock;
  InMemoryEntryStore by_utility(2 * kEvictEntryBytes, utility_on(clock));
  InMemoryEntryStore by_recency(2 * kEvictEntryBytes);
  for (EntryStore* store : {static_cast<EntryStore*>(&by_utility), static_cast<EntryStore*>(&by_recency)}) {
    clock.now = 0.0;
    put(*store, 1);
    clock.now = 1.0;
    for (int lookup = 0; lookup < 4; ++lookup)
      REQUIRE(store->get(key_of(1)));
    clock.now = 10.0;
    put(*store, 2);
    clock.now = 20.0;
    put(*store, 3);
  }
  CHECK(by_utility.stats().eviction_policy == "utility");
  CHECK(by_utility.stats().budget_evictions == 1);
  CHECK(held(by_utility, 1));
  CHECK_FALSE(held(by_utility, 2));
  CHECK(by_recency.stats().budget_evictions == 1);
  CHECK_FALSE(held(by_recency, 1));
  CHECK(held(by_recency, 2));

  // The listing: by utility, with the hits the store counted (4 before, 1 by held() above).
  const auto top = by_utility.top(10);
  REQUIRE(top.size() == 2);
  CHECK(top[0].key == key_of(1));
  CHECK(top[0].hits == 5);
  REQUIRE(top[0].utility);
  REQUIRE(top[1].utility);
  CHECK(*top[0].utility > *top[1].utility);
  CHECK(top[0].fidelity.is_exact());
}

TEST_CASE("eviction by utility: a route's priority raises an entry, directly or through a prefix of it",
          "[kv_store][eviction]") {
  TestClock clock;
  InMemoryEntryStore store(2 * kEvictEntryBytes, utility_on(clock));
  put(store, 1);
  store.note_use(key_of(1), 5);  // published on a priority-5 route
  clock.now = 1.0;
  put(store, 2);
  clock.now = 2.0;
  put(store, 3);  // 1 is older, but its route outranks 2's
  CHECK(held(store, 1));
  CHECK_FALSE(held(store, 2));
  store.note_use(key_of(404), 7);  // nothing there: ignored

  // A long entry raised through the key of its first block (a lookup served that prefix).
  TestClock chained_clock;
  InMemoryEntryStore chained(3 * 2 * kEvictEntryBytes, utility_on(chained_clock));
  const auto long_keys = put_chained_entry(chained, evict_chain(2, 1));
  chained.note_use(key_of(long_keys[0]), 6);
  chained_clock.now = 1.0;
  const auto newer = put_chained_entry(chained, evict_chain(2, 2));
  chained_clock.now = 2.0;
  put_chained_entry(chained, evict_chain(2, 3));
  chained_clock.now = 3.0;
  put_chained_entry(chained, evict_chain(2, 4));
  CHECK(chained.get(key_of(long_keys.back())) != nullptr);
  CHECK(chained.get(key_of(newer.back())) == nullptr);
}

TEST_CASE("eviction by utility: make_arena_room drops the arena's lowest-utility entries", "[kv_store][eviction]") {
  auto arena = ShmArena::create(4 * ShmArena::kGranule);
  REQUIRE(arena);
  TestClock clock;
  InMemoryEntryStore store(1 << 30, utility_on(clock));
  const std::uint64_t granule_tokens = ShmArena::kGranule / (2 * 4 * sizeof(float));  // one granule each
  for (std::uint64_t hash = 1; hash <= 4; ++hash) {
    clock.now = static_cast<double>(hash);
    REQUIRE(store.put(key_of(hash), evict_entry(granule_tokens, arena.value().get())));
  }
  REQUIRE(store.get(key_of(1))->in_arena());
  clock.now = 5.0;
  for (const std::uint64_t hash : {1ULL, 1ULL, 2ULL, 4ULL, 4ULL, 4ULL})
    REQUIRE(store.get(key_of(hash)));
  const auto reader = store.get(key_of(3));  // held by a reader: cannot free its block
  REQUIRE_FALSE(arena.value()->fits(ShmArena::kGranule));
  REQUIRE(store.make_arena_room(*arena.value(), 2 * ShmArena::kGranule));
  // Hits (the put's included): 1 and 4 four each, 2 and 3 two. 2 and 3 are the lowest, but a
  // reader holds 3, so 2 goes, then 1 (ties with 4 go by key).
  CHECK(held(store, 3));
  CHECK(held(store, 4));
  CHECK(store.stats().arena_evictions == 2);
  CHECK(store.stats().budget_evictions == 0);
  const int left = static_cast<int>(held(store, 1)) + static_cast<int>(held(store, 2));
  CHECK(left == 0);
  CHECK(arena.value()->fits(2 * ShmArena::kGranule));
}

TEST_CASE("eviction by utility: an evicted entry's prefix index rows go with it, and prefix hits count",
          "[kv_store][eviction][prefix_index]") {
  TestClock clock;
  InMemoryEntryStore store(2 * 4 * kEvictEntryBytes, utility_on(clock));  // two 4-block entries
  const auto first = put_chained_entry(store, evict_chain(4, 1));
  const auto accept_all = [](const StoredEntry&, std::size_t) { return true; };
  clock.now = 1.0;
  for (int lookup = 0; lookup < 3; ++lookup) {
    const auto hit = store.find_prefix(key_of(first[1]), accept_all);
    REQUIRE(hit);
    CHECK(hit->blocks == 2);
  }
  clock.now = 2.0;
  const auto second = put_chained_entry(store, evict_chain(4, 2));
  REQUIRE(store.find_prefix(key_of(second[0]), accept_all));
  clock.now = 3.0;
  const auto third = put_chained_entry(store, evict_chain(4, 3));  // evicts one: the second, hit once
  CHECK(store.stats().budget_evictions == 1);
  CHECK(store.get(key_of(first.back())) != nullptr);  // its prefix hits counted as hits on it
  CHECK(store.get(key_of(second.back())) == nullptr);
  for (std::size_t block = 0; block + 1 < second.size(); ++block)
    CHECK_FALSE(store.find_prefix(key_of(second[block]), accept_all));
  CHECK(store.find_prefix(key_of(first[2]), accept_all));
  CHECK(store.find_prefix(key_of(third[0]), accept_all));
  store.clear();
  CHECK(store.top(10).empty());
  CHECK_FALSE(store.find_prefix(key_of(first[0]), accept_all));
}

TEST_CASE("eviction by utility: the recency tau is read when victims are chosen", "[kv_store][eviction]") {
  TestClock clock;
  clock.tau = 1000.0;  // slow decay: frequency decides
  InMemoryEntryStore store(2 * kEvictEntryBytes, utility_on(clock));
  put(store, 1);
  for (int lookup = 0; lookup < 3; ++lookup)
    REQUIRE(store.get(key_of(1)));
  clock.now = 100.0;
  put(store, 2);
  clock.tau = 10.0;  // a reload: fast decay, recency decides
  clock.now = 101.0;
  put(store, 3);
  CHECK_FALSE(store.get(key_of(1)));
  CHECK(store.get(key_of(2)));
}

namespace {

// Records what the store offers; wants what `wanted` says (the daemon's sink is broker::Spiller,
// proven end to end in tests/broker/spill_process_test.cpp).
struct RecordingSink final : SpillSink {
  std::function<bool(std::optional<double>)> wanted = [](std::optional<double>) { return true; };
  std::vector<std::optional<double>> asked;
  std::vector<EntryKey> offered;
  bool wants(const EntryKey& /*key*/, const StoredEntry& /*entry*/, std::optional<double> utility) override {
    asked.push_back(utility);
    return wanted(utility);
  }
  void offer(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) override {
    REQUIRE(entry);
    offered.push_back(key);
  }
};

}  // namespace

TEST_CASE("budget victims the sink wants become stubs until their spill ends", "[kv_store][spill][unit]") {
  TestClock clock;
  auto store = std::make_shared<InMemoryEntryStore>(2 * kEvictEntryBytes, utility_on(clock));
  auto sink = std::make_shared<RecordingSink>();
  store->set_spill_sink(sink);
  put(*store, 1);
  clock.now = 1.0;
  put(*store, 2);
  clock.now = 2.0;
  put(*store, 3);  // 1 is the victim, asked with its utility and offered
  REQUIRE(sink->offered.size() == 1);
  CHECK(sink->offered.front() == key_of(1));
  REQUIRE(sink->asked.size() == 1);
  CHECK(sink->asked.front().has_value());
  CHECK_FALSE(store->get(key_of(1)));
  auto stats = store->stats();
  CHECK(stats.stubs == 1);
  CHECK(stats.spilling_bytes == kEvictEntryBytes);
  CHECK(stats.budget_evictions == 1);
  const std::vector<std::uint64_t> hashes{1};
  CHECK_FALSE(store->longest_stub(kEvictModel, hashes));  // in flight: nowhere to fetch it yet

  SECTION("a spill that ends well points the stub at its peer") {
    store->spill_done(key_of(1), "node-b", true, "int8");
    const auto stub = store->longest_stub(kEvictModel, hashes);
    REQUIRE(stub);
    CHECK(stub->peer == "node-b");
    CHECK(stub->codec == "int8");
    CHECK(stub->bytes == kEvictEntryBytes);
    CHECK(store->stats().spills == 1);
    CHECK(store->stats().spilling_bytes == 0);
    // The entry comes back: the stub stands for nothing any more.
    put(*store, 1);
    CHECK_FALSE(store->longest_stub(kEvictModel, hashes));
    CHECK(store->stats().stubs <= 1);  // 1's put may have spilled another victim
  }
  SECTION("a stub whose peer lost the entry is forgotten") {
    store->spill_done(key_of(1), "node-b", true, "lossless");
    CHECK(store->forget_stub(key_of(1)));
    CHECK_FALSE(store->forget_stub(key_of(1)));
    CHECK_FALSE(store->longest_stub(kEvictModel, hashes));
    CHECK(store->stats().stubs == 0);
  }
  SECTION("a spill that fails leaves no stub: the victim is gone") {
    store->spill_done(key_of(1), "node-b", false);
    CHECK_FALSE(store->longest_stub(kEvictModel, hashes));
    CHECK(store->stats().stubs == 0);
    CHECK(store->stats().spill_failures == 1);
  }
}

TEST_CASE("victims the sink does not want, and peers' spills, are dropped", "[kv_store][spill][unit]") {
  TestClock clock;
  auto store = std::make_shared<InMemoryEntryStore>(kEvictEntryBytes, utility_on(clock));
  auto sink = std::make_shared<RecordingSink>();
  store->set_spill_sink(sink);
  sink->wanted = [](std::optional<double> utility) { return utility && *utility > 100.0; };
  put(*store, 1);
  put(*store, 2);
  CHECK(sink->offered.empty());
  CHECK(store->stats().stubs == 0);
  // An entry a peer spilled here is that peer's: never spilled on, whatever the sink says.
  auto spilled_in = share_entry(*evict_entry(kEvictBlockTokens));
  REQUIRE(spilled_in);
  spilled_in.value()->origin = EntryOrigin::kSpilledIn;
  spilled_in.value()->spilled_from = "node-a";
  REQUIRE(store->put(key_of(3), spilled_in.value()));
  CHECK(store->spilled_in_bytes("node-a") == kEvictEntryBytes);
  sink->wanted = [](std::optional<double>) { return true; };
  put(*store, 4);
  CHECK(sink->offered.size() == 0);
  CHECK(store->spilled_in_bytes("node-a") == 0);
  // A sink gone (the daemon stopping) spills nothing.
  sink.reset();
  put(*store, 5);
  CHECK(store->stats().stubs == 0);
}

TEST_CASE("a peer's spills are filed within its quota, checked as they are filed", "[kv_store][spill][unit]") {
  InMemoryEntryStore store(16 * kEvictEntryBytes);
  const auto spilled = [](const std::string& peer) {
    auto entry = share_entry(*evict_entry(kEvictBlockTokens));
    REQUIRE(entry);
    entry.value()->origin = EntryOrigin::kSpilledIn;
    entry.value()->spilled_from = peer;
    return std::shared_ptr<const StoredEntry>(std::move(entry).value());
  };
  const std::uint64_t quota = 2 * kEvictEntryBytes;
  REQUIRE(store.put_spilled(key_of(1), spilled("node-a"), quota));
  REQUIRE(store.put_spilled(key_of(2), spilled("node-a"), quota));
  // A third is over node-a's quota; node-b's spills count apart.
  const auto over = store.put_spilled(key_of(3), spilled("node-a"), quota);
  REQUIRE_FALSE(over);
  CHECK(over.error().code == ErrorCode::kResourceExhausted);
  CHECK_FALSE(store.get(key_of(3)));
  REQUIRE(store.put_spilled(key_of(3), spilled("node-b"), quota));
  // The same key spilled again replaces the old copy without counting it twice.
  REQUIRE(store.put_spilled(key_of(2), spilled("node-a"), quota));
  CHECK(store.spilled_in_bytes("node-a") == quota);
  // This node's own entry under a key is never replaced by a spill.
  put(store, 9);
  const auto own = store.put_spilled(key_of(9), spilled("node-b"), quota);
  REQUIRE_FALSE(own);
  CHECK(own.error().code == ErrorCode::kAlreadyExists);
  CHECK(store.get(key_of(9))->origin == EntryOrigin::kPublished);
}
