// The one longest-prefix scan: coverage, the prompt's limit and each fidelity rule; the store's
// prefix index (a longer entry's first blocks), opted into per query.

#include "kvrelay/kv_store/prefix_scan.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "kvrelay/kv_store/entry_chain.h"

using namespace kvrelay;
using namespace kvrelay::kv_store;

namespace {

constexpr std::uint64_t kScanModel = 9;
constexpr std::uint32_t kScanBlockTokens = 16;
const std::vector<std::uint64_t> kScanChain = {501, 502, 503, 504};

std::shared_ptr<const StoredEntry> scan_entry(std::uint64_t tokens, Fidelity fidelity = {}) {
  const KvLayout layout{1, 1, 4, DType::kFloat32, tokens};
  const std::vector<std::byte> kv(layout.total_bytes().value(), std::byte{1});
  auto made = make_stored_entry(layout, kv);
  REQUIRE(made);
  made.value()->fidelity = std::move(fidelity);
  return made.value();
}

PrefixQuery scan_of(FidelityRule rule, std::size_t max_blocks = 4) {
  return {kScanModel, kScanChain, max_blocks, kScanBlockTokens, std::move(rule)};
}

// `blocks` blocks of token ids: the first `shared` blocks' the same for every seed, the rest the seed's.
EntryChain index_chain(std::size_t blocks, std::size_t shared, std::uint32_t seed, std::string tenant = "") {
  EntryChain chain;
  chain.block_tokens = kScanBlockTokens;
  chain.tenant = std::move(tenant);
  for (std::size_t token = 0; token < blocks * kScanBlockTokens; ++token) {
    const bool common = token < shared * kScanBlockTokens;
    chain.tokens.push_back(static_cast<TokenId>(common ? token * 7 + 1 : token * 13 + seed * 1000));
  }
  return chain;
}

ChainScope scope_of(const EntryChain& chain) {
  return chain.tenant.empty() ? ChainScope::kUnscoped : ChainScope::kTenant;
}

std::vector<std::uint64_t> keys_of(const EntryChain& chain) {
  return chain_keys(kScanModel, chain, scope_of(chain));
}

// An entry holding `chain`'s tokens, filed under its last block's key (a verified chain).
std::shared_ptr<const StoredEntry> put_chained(InMemoryEntryStore& store, const EntryChain& chain,
                                               Fidelity fidelity = {}) {
  const KvLayout layout{1, 1, 4, DType::kFloat32, chain.tokens.size()};
  const std::vector<std::byte> kv(layout.total_bytes().value(), std::byte{2});
  auto made = make_stored_entry(layout, kv);
  REQUIRE(made);
  made.value()->fidelity = std::move(fidelity);
  made.value()->chain = std::make_shared<const EntryChain>(chain);
  std::shared_ptr<const StoredEntry> entry = made.value();
  REQUIRE(store.put({kScanModel, keys_of(chain).back()}, entry));
  return entry;
}

PrefixQuery longer_scan(const std::vector<std::uint64_t>& chain, FidelityRule rule = FidelityRule::exact_only()) {
  return {kScanModel, chain, chain.size(), kScanBlockTokens, std::move(rule), true};
}

}  // namespace

TEST_CASE("prefix scan: the longest covered prefix, within the limit", "[kv_store][prefix_scan]") {
  InMemoryEntryStore store(1 << 20);
  CHECK_FALSE(longest_held_prefix(store, scan_of(FidelityRule::exact_only())));
  REQUIRE(store.put({kScanModel, 501}, scan_entry(16)));
  REQUIRE(store.put({kScanModel, 503}, scan_entry(48)));
  REQUIRE(store.put({kScanModel, 504}, scan_entry(50)));  // does not hold exactly 4 blocks
  const auto held = longest_held_prefix(store, scan_of(FidelityRule::exact_only()));
  CHECK(held.blocks == 3);
  CHECK(held.entry->info.layout.tokens == 48);
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::exact_only(), 2)).blocks == 1);
  CHECK_FALSE(longest_held_prefix(store, scan_of(FidelityRule::exact_only(), 0)));
  // Without a block size any entry with KV counts.
  auto any_size = scan_of(FidelityRule::exact_only());
  any_size.block_tokens = 0;
  CHECK(longest_held_prefix(store, any_size).blocks == 4);
  // Another model's chain is not this one.
  auto other_model = scan_of(FidelityRule::any());
  other_model.model_id = kScanModel + 1;
  CHECK_FALSE(longest_held_prefix(store, other_model));
}

TEST_CASE("prefix scan: exact only, exact or one lossy codec, or any", "[kv_store][prefix_scan]") {
  InMemoryEntryStore store(1 << 20);
  REQUIRE(store.put({kScanModel, 501}, scan_entry(16)));
  REQUIRE(store.put({kScanModel, 502}, scan_entry(32, Fidelity::lossy("int4"))));
  REQUIRE(store.put({kScanModel, 503}, scan_entry(48, Fidelity::lossy("int8", 16))));
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::exact_only())).blocks == 1);
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::exact_or_lossy("int8"))).blocks == 3);
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::exact_or_lossy("int4"))).blocks == 2);
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::exact_or_lossy("fp8"))).blocks == 1);
  CHECK(longest_held_prefix(store, scan_of(FidelityRule::any())).blocks == 3);
  CHECK(FidelityRule::exact_or_lossy("int8").accepts(Fidelity::exact()));
  CHECK_FALSE(FidelityRule::exact_only().accepts(Fidelity::lossy("int8", 100)));
}

TEST_CASE("prefix index: a prompt sharing a held entry's first blocks finds them, when the scan opts in",
          "[kv_store][prefix_scan][prefix_index]") {
  InMemoryEntryStore store(1 << 20);
  const auto held = put_chained(store, index_chain(4, 4, 1));
  // A prompt of 4 blocks that shares the first 2 and then diverges (another question).
  const auto branch = keys_of(index_chain(4, 2, 2));
  CHECK(branch[1] == keys_of(index_chain(4, 4, 1))[1]);
  CHECK(branch[2] != keys_of(index_chain(4, 4, 1))[2]);
  auto plain = longer_scan(branch);
  plain.allow_longer = false;
  CHECK_FALSE(longest_held_prefix(store, plain));  // the default: whole entries only
  const auto found = longest_held_prefix(store, longer_scan(branch));
  REQUIRE(found);
  CHECK(found.blocks == 2);
  CHECK(found.entry == held);
  CHECK(found.entry->info.layout.tokens == 4 * kScanBlockTokens);
  CHECK(found.fidelity(kScanBlockTokens).is_exact());
  // The prompt's limit still holds, and without a block size the index is not asked.
  auto limited = longer_scan(branch);
  limited.max_blocks = 1;
  CHECK(longest_held_prefix(store, limited).blocks == 1);
  auto sizeless = longer_scan(branch);
  sizeless.block_tokens = 0;
  CHECK_FALSE(longest_held_prefix(store, sizeless));
  // Another model's chain of the same hashes is not this one.
  auto other_model = longer_scan(branch);
  other_model.model_id = kScanModel + 1;
  CHECK_FALSE(longest_held_prefix(store, other_model));
  // The whole entry's own chain still finds it whole.
  CHECK(longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 4, 1)))).blocks == 4);
}

TEST_CASE("prefix index: an entry filed under the prefix's own key wins over a longer one",
          "[kv_store][prefix_scan][prefix_index]") {
  InMemoryEntryStore store(1 << 20);
  const auto longer = put_chained(store, index_chain(4, 4, 1));
  const auto own = put_chained(store, index_chain(2, 2, 3));  // the same first 2 blocks, filed under block 2
  const auto found = longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 2, 2))));
  CHECK(found.blocks == 2);
  CHECK(found.entry == own);
  // A longer prefix, though held only inside the longer entry, beats a shorter exact key.
  const auto three = longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 3, 4))));
  CHECK(three.blocks == 3);
  CHECK(three.entry == longer);
}

TEST_CASE("prefix index: never across tenants", "[kv_store][prefix_scan][prefix_index][security]") {
  InMemoryEntryStore store(1 << 20);
  const auto held = put_chained(store, index_chain(4, 4, 1, "acme"));
  const auto found = longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 2, 2, "acme"))));
  CHECK(found.blocks == 2);
  CHECK(found.entry == held);
  CHECK_FALSE(longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 2, 2, "globex")))));
  CHECK_FALSE(longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 2, 2)))));  // unscoped
}

TEST_CASE("prefix index: erasing or evicting an entry drops its rows, and unverified chains are not indexed",
          "[kv_store][prefix_scan][prefix_index]") {
  const auto branch = keys_of(index_chain(4, 2, 2));
  const std::uint64_t entry_bytes = 4 * kScanBlockTokens * 2 * 4 * sizeof(float);
  {
    InMemoryEntryStore store(1 << 20);
    const auto chain = index_chain(4, 4, 1);
    put_chained(store, chain);
    REQUIRE(longest_held_prefix(store, longer_scan(branch)));
    REQUIRE(store.erase({kScanModel, keys_of(chain).back()}));
    CHECK_FALSE(longest_held_prefix(store, longer_scan(branch)));
    put_chained(store, chain);
    store.clear();
    CHECK_FALSE(longest_held_prefix(store, longer_scan(branch)));
  }
  {
    InMemoryEntryStore store(entry_bytes);  // room for one entry
    put_chained(store, index_chain(4, 4, 1));
    REQUIRE(longest_held_prefix(store, longer_scan(branch)));
    put_chained(store, index_chain(4, 0, 5));  // evicts the first
    CHECK(store.stats().evictions == 1);
    CHECK_FALSE(longest_held_prefix(store, longer_scan(branch)));
  }
  {
    InMemoryEntryStore store(1 << 20);
    // Filed under a key its token ids do not hash to: not trusted, so not indexed.
    const auto chain = index_chain(4, 4, 1);
    const KvLayout layout{1, 1, 4, DType::kFloat32, chain.tokens.size()};
    auto made = make_stored_entry(layout, std::vector<std::byte>(layout.total_bytes().value()));
    REQUIRE(made);
    made.value()->chain = std::make_shared<const EntryChain>(chain);
    REQUIRE(store.put({kScanModel, 12345}, made.value()));
    CHECK_FALSE(longest_held_prefix(store, longer_scan(branch)));
    // Without a chain: not indexed either.
    auto bare = make_stored_entry(layout, std::vector<std::byte>(layout.total_bytes().value()));
    REQUIRE(bare);
    REQUIRE(store.put({kScanModel, keys_of(chain).back()}, bare.value()));
    CHECK_FALSE(longest_held_prefix(store, longer_scan(branch)));
  }
}

TEST_CASE("prefix index: the fidelity rule judges the prefix served, the most exact then the newest wins",
          "[kv_store][prefix_scan][prefix_index]") {
  InMemoryEntryStore store(1 << 20);
  // Exact for its first 2 blocks, int8 after: an exact source for a 2-block prefix.
  const auto turns_lossy = put_chained(store, index_chain(4, 4, 1), Fidelity::lossy("int8", 2 * kScanBlockTokens));
  const auto two = longest_held_prefix(store, longer_scan(keys_of(index_chain(4, 2, 2))));
  CHECK(two.blocks == 2);
  CHECK(two.entry == turns_lossy);
  CHECK(two.fidelity(kScanBlockTokens).is_exact());
  // Its 3-block prefix is lossy: exact only falls back to 2 blocks, the int8 rule takes 3.
  const auto three_chain = keys_of(index_chain(4, 3, 3));
  CHECK(longest_held_prefix(store, longer_scan(three_chain)).blocks == 2);
  const auto lossy = longest_held_prefix(store, longer_scan(three_chain, FidelityRule::exact_or_lossy("int8")));
  CHECK(lossy.blocks == 3);
  CHECK_FALSE(lossy.fidelity(kScanBlockTokens).is_exact());
  CHECK(longest_held_prefix(store, longer_scan(three_chain, FidelityRule::exact_or_lossy("int4"))).blocks == 2);

  // Two entries share 3 blocks: the one exact through them wins, though filed first.
  InMemoryEntryStore both(1 << 20);
  const auto exact = put_chained(both, index_chain(4, 3, 6));
  put_chained(both, index_chain(4, 3, 7), Fidelity::lossy("int8", kScanBlockTokens));
  CHECK(longest_held_prefix(both, longer_scan(three_chain, FidelityRule::any())).entry == exact);
  // Of two as exact, the newest.
  const auto newest = put_chained(both, index_chain(4, 3, 8));
  CHECK(longest_held_prefix(both, longer_scan(three_chain)).entry == newest);
  // Erasing the newest leaves the older row answering.
  REQUIRE(both.erase({kScanModel, keys_of(index_chain(4, 3, 8)).back()}));
  CHECK(longest_held_prefix(both, longer_scan(three_chain)).entry == exact);
}
