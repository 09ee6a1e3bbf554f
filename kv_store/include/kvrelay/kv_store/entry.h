#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/core/fidelity.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/unique_fd.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/memfd.h"

namespace kvrelay::kv_store {

// What an entry is filed under: the model fingerprint id and a digest of the context (e.g.
// the last block hash of its token chain).
struct EntryKey {
  std::uint64_t model_id = 0;
  std::uint64_t context_hash = 0;
  friend bool operator==(const EntryKey&, const EntryKey&) = default;
};

struct EntryKeyHash {
  std::size_t operator()(const EntryKey& key) const noexcept {
    return static_cast<std::size_t>(key.model_id * 0x9E3779B97F4A7C15ULL ^ key.context_hash);
  }
};

// Metadata that travels with every entry. layout.layers == 0 marks an opaque blob (no KV
// layout): the transports move any bytes; KV entries must match their layout exactly.
struct EntryInfo {
  KvLayout layout{};
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;  // xxh3_64 of the bytes
};

// How an entry came to this store (issue #27; GET /admin/kv lists it). A prefetched entry's local
// hits count as prefetch hits; a spilled-in one is held for the peer that spilled it, counted
// against that peer's accept_spill_bytes, and never spilled again.
enum class EntryOrigin : std::uint8_t { kPublished, kFetched, kPushed, kPrefetched, kSpilledIn };
[[nodiscard]] std::string_view entry_origin_name(EntryOrigin origin) noexcept;

// A committed entry: immutable bytes, either in its own memfd sealed against writes and resizes
// (`fd`), or in a block of the sidecar's arena (`block`, and `fd` empty).
struct EntryChain;
struct StoredEntry {
  EntryInfo info;
  Fidelity fidelity;  // how faithful these bytes are to the source's KV; the store enforces it
  // The token ids the entry's key was verified against (entry_chain.h). Null: KV a client
  // published without them, which is served here but never leaves this node.
  std::shared_ptr<const EntryChain> chain;
  EntryOrigin origin = EntryOrigin::kPublished;
  std::string spilled_from;  // kSpilledIn: the peer whose spill it is
  UniqueFd fd;
  std::shared_ptr<const ArenaBlock> block;
  [[nodiscard]] bool in_arena() const noexcept { return block != nullptr; }
};

// An entry's bytes readable in this process: the arena block in place, or a read-only mapping
// of its memfd. Keeps what it views alive.
class EntryView {
 public:
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return view_; }

 private:
  friend Result<EntryView> view_entry(const StoredEntry& entry);
  std::shared_ptr<const ArenaBlock> block_;
  Mapping mapping_;
  std::span<const std::byte> view_;
};
[[nodiscard]] Result<EntryView> view_entry(const StoredEntry& entry);

// Copies `out.size()` bytes from `offset` of the entry into `out` (pread for a memfd entry).
[[nodiscard]] Status read_entry(const StoredEntry& entry, std::uint64_t offset, std::span<std::byte> out);

// Opaque entries carry layers == 0; everything else must describe exactly `bytes`.
[[nodiscard]] Status validate_entry_info(const EntryInfo& info);

// An entry the sidecar creates itself (fetched from a peer, decoded, sliced): a copy of
// `bytes` with its checksum, validated like a commit; in a block of `arena` when one is given
// and has room, else in a fresh memfd sealed against writes.
[[nodiscard]] Result<std::shared_ptr<StoredEntry>> make_stored_entry(const KvLayout& layout,
                                                                     std::span<const std::byte> bytes,
                                                                     ShmArena* arena = nullptr);

// The same sealed bytes as `entry` (a duplicate of its memfd, or its arena block shared) with
// its metadata, to be filed under another key with other metadata (a tenant's chain).
[[nodiscard]] Result<std::shared_ptr<StoredEntry>> share_entry(const StoredEntry& entry);

// Wire encodings shared by the control and peer protocols (see docs/wire-format.md).
inline constexpr std::size_t kEncodedKeyBytes = 16;
inline constexpr std::size_t kEncodedLayoutBytes = 24;
void encode_key(ByteWriter& writer, const EntryKey& key);
[[nodiscard]] std::optional<EntryKey> decode_key(ByteReader& reader);
void encode_layout(ByteWriter& writer, const KvLayout& layout);
// Fails on unknown dtypes or nonzero padding; structural checks are validate_entry_info's job.
[[nodiscard]] Result<KvLayout> decode_layout(ByteReader& reader);

}  // namespace kvrelay::kv_store
