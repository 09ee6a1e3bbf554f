#pragma once

// Stage three of a lookup: turning held and fetched KV into the entry the worker is served (a
// fetched frame decoded and joined to the held prefix, a slice to the servable blocks, the
// codec round trip a lossy medium implies on one node). No network I/O; sealed memory only.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::broker {

// A peer's frame as an entry of the whole prefix.
struct FrameEntry {
  std::shared_ptr<const kv_store::StoredEntry> entry;
  std::uint64_t raw_bytes = 0;  // decoded KV of the frame alone (the delta)
  DType dtype = DType::kFloat32;
  double decode_seconds = 0.0;  // checking and decoding the frame
  double filing_seconds = 0.0;  // making the entry (a join with `held`, or a new one)
};

struct FrameToEntry {
  const codec::CodecRegistry& codecs;
  std::span<const std::uint8_t> frame;
  const kv_store::StoredEntry* held = nullptr;  // the prefix the frame continues, if any
  std::uint64_t expected_tokens = 0;            // what held + frame must cover
  const std::string& asked_codec;
  bool lossless_requested = true;  // a lossy frame is then refused
  std::uint64_t max_bytes = 0;
  WarmBufferPool& buffers;
  kv_store::ShmArena* arena = nullptr;
  std::shared_ptr<const kv_store::EntryChain> chain;  // the whole prefix's token ids, verified
  double fidelity_product = 1.0;                      // what the source stamped: lossy KV carries it
};

// Errors carry the text a fetch attempt records ("entry does not cover its blocks", ...).
[[nodiscard]] Result<FrameEntry> entry_from_frame(const FrameToEntry& in);

// What a lossy medium's round trip on this node cost, for the engine's codec estimates.
struct CodecRoundTrip {
  std::uint64_t frame_bytes = 0;
  double encode_seconds = 0.0;
  double decode_seconds = 0.0;  // includes filing the entry: an upper bound
};

struct ServedEntry {
  std::shared_ptr<const kv_store::StoredEntry> entry;
  std::size_t blocks = 0;
  std::optional<CodecRoundTrip> round_trip;
};

struct ServeInputs {
  const codec::CodecRegistry& codecs;
  std::shared_ptr<const kv_store::StoredEntry> entry;
  std::size_t entry_blocks = 0;
  std::size_t max_blocks = 0;
  std::uint32_t block_tokens = 0;
  const std::string& codec;
  // KV that has not been through the medium's lossy codec: same node, but the worker gets
  // exactly what the codec delivers.
  bool needs_round_trip = false;
  std::uint64_t max_bytes = 0;
  kv_store::ShmArena* arena = nullptr;
  // A span (issue #28): serve blocks first_block..min(entry_blocks, max_blocks) only.
  std::size_t first_block = 0;
};

// The entry cut to its first min(entry_blocks, max_blocks) blocks (an entry longer than the
// prefix it stands for, too), from first_block on, and, when asked, through the codec and back.
// `blocks` counts the blocks served from first_block.
[[nodiscard]] Result<ServedEntry> entry_to_serve(ServeInputs in);

}  // namespace kvrelay::broker
