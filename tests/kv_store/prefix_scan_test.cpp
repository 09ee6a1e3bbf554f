// The one longest-prefix scan: coverage, the prompt's limit and each fidelity rule.

#include "kvrelay/kv_store/prefix_scan.h"

#include <catch2/catch.hpp>

#include <vector>

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
