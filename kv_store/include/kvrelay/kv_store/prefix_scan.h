#pragma once

// The one longest-prefix scan of the store: the KV path's held prefix, the data plane's
// store-only resolve and a peer's Fetch all ask it, so they share one rule for which stored
// entry stands for a prefix of a block chain and which fidelity may answer.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>

#include "kvrelay/core/fidelity.h"
#include "kvrelay/kv_store/entry_store.h"

namespace kvrelay::kv_store {

// Which stored KV may answer a scan.
class FidelityRule {
 public:
  // Exact entries only: what a lookup or fetch that chose a lossless codec may use.
  [[nodiscard]] static FidelityRule exact_only() { return FidelityRule(Kind::kExactOnly, {}); }
  // Exact entries, or lossy ones made by `codec` (a spec: "int4+zstd"): what that codec delivers.
  [[nodiscard]] static FidelityRule exact_or_lossy(std::string codec) {
    return FidelityRule(Kind::kExactOrCodec, std::move(codec));
  }
  // Any entry, of whatever fidelity (the caller re-encodes and labels it itself).
  [[nodiscard]] static FidelityRule any() { return FidelityRule(Kind::kAny, {}); }

  [[nodiscard]] bool accepts(const Fidelity& fidelity) const;

 private:
  enum class Kind { kExactOnly, kExactOrCodec, kAny };
  FidelityRule(Kind kind, std::string codec) : kind_(kind), codec_(std::move(codec)) {}
  Kind kind_;
  std::string codec_;
};

struct PrefixQuery {
  std::uint64_t model_id = 0;
  // Block hashes in chain order: the entry for the first i + 1 blocks is filed under chain[i].
  std::span<const std::uint64_t> chain;
  // Longest prefix worth a look, in blocks (a lookup never takes the prompt's last token).
  std::size_t max_blocks = std::numeric_limits<std::size_t>::max();
  // Non-zero: an entry stands for i + 1 blocks only when it holds exactly (i + 1) * block_tokens
  // tokens. Zero (callers that do not know the block size): any entry with KV in it.
  std::uint64_t block_tokens = 0;
  FidelityRule fidelity = FidelityRule::exact_only();
  // Also an entry of more blocks that holds these first (the store's prefix index: a branch of
  // a conversation, one system prompt then another question). Needs block_tokens; the rule then
  // judges the prefix's fidelity, not the whole entry's. Off by default: a consumer opts in when
  // it serves only the prefix (slice_entry), never the longer entry as it is.
  bool allow_longer = false;
};

struct HeldPrefix {
  std::shared_ptr<const StoredEntry> entry;  // null when the store holds no usable prefix
  // chain[blocks - 1] is the entry's key; or, under allow_longer, the key of the entry's block
  // `blocks - 1` (the entry holds more than blocks * block_tokens tokens).
  std::size_t blocks = 0;
  [[nodiscard]] explicit operator bool() const { return entry != nullptr; }
  // The fidelity of the prefix alone (the whole entry's when block_tokens is 0).
  [[nodiscard]] Fidelity fidelity(std::uint64_t block_tokens) const {
    return block_tokens == 0 ? entry->fidelity : entry->fidelity.prefix(blocks * block_tokens);
  }
};

// The longest prefix of `query.chain` (at most max_blocks) that the store holds under the
// fidelity rule, longest first; none when nothing usable is held. At one length an entry filed
// under the key itself wins over a longer entry that holds the prefix.
[[nodiscard]] HeldPrefix longest_held_prefix(EntryStore& store, const PrefixQuery& query);

}  // namespace kvrelay::kv_store
