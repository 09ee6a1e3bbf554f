#pragma once

// What each KV medium means for bytes: which codec carries it, and the conversions the KV path
// applies to stored entries (a prefix slice, a codec round trip, decoding a peer's frame).

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::broker {

// Codec spec of a KV medium, from the media catalogue (decision/media.h): kv_raw -> raw,
// kv_lossless -> lossless, kv_int8 -> int8, kv_int4 -> int4, kv_fp8 -> fp8, codec:<name> ->
// <name>. nullopt for tokens and for media the KV path cannot serve to a prefix cache
// (kv_sparse drops positions).
[[nodiscard]] std::optional<std::string> codec_for_medium(std::string_view medium);
// The medium a codec spec carries (the inverse, for byte counters of the peer server).
[[nodiscard]] std::string medium_for_codec(std::string_view codec);

// New entries below go into `arena` when one is given and has room, else into sealed memfds.

// A prefix slice is kv_store::slice_entry (kvrelay/kv_store/entry_slice.h), shared with the data plane.

// The KV of `head` followed token-wise by `tail` (`tail_layout`, same model shape), as a new
// sealed entry: a prefix this sidecar held joined to the rest fetched from a peer. `head` is
// read through the kernel and joined in buffers from `buffers`, never in fresh memory. Its
// fidelity is exact up to the first lossy token of either part; `chain` the whole's token ids.
[[nodiscard]] Result<std::shared_ptr<const kv_store::StoredEntry>> join_entry(
    const kv_store::StoredEntry& head, const KvLayout& tail_layout, std::span<const std::byte> tail,
    const Fidelity& tail_fidelity, std::shared_ptr<const kv_store::EntryChain> chain, WarmBufferPool& buffers,
    kv_store::ShmArena* arena = nullptr);

// Encodes an entry's KV with `codec_spec` into a KV frame.
[[nodiscard]] Result<std::vector<std::uint8_t>> encode_entry(const codec::CodecRegistry& codecs,
                                                             std::string_view codec_spec,
                                                             const kv_store::StoredEntry& entry);

// Decodes a KV frame (validated: magic, version, codec, layout, sizes, checksum) into a sealed
// entry of raw KV, lossy unless the frame's codec is lossless; refuses frames whose KV exceeds
// `max_bytes`.
[[nodiscard]] Result<std::shared_ptr<const kv_store::StoredEntry>> decode_entry(const codec::CodecRegistry& codecs,
                                                                                std::span<const std::uint8_t> frame,
                                                                                std::uint64_t max_bytes,
                                                                                kv_store::ShmArena* arena = nullptr);

}  // namespace kvrelay::broker
