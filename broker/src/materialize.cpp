#include "materialize.h"

#include <fmt/format.h>

#include <chrono>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/kv_store/entry_slice.h"

#include "kv_media.h"

namespace kvrelay::broker {

namespace {

using MaterializeClock = std::chrono::steady_clock;

double seconds_between(MaterializeClock::time_point from, MaterializeClock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

Result<FrameEntry> entry_from_frame(const FrameToEntry& in) {
  const auto started = MaterializeClock::now();
  // A raw frame is filed straight from the receive buffer; other codecs decode into a warm one.
  auto decoded = codec::decode_frame_view(in.codecs, in.frame, in.max_bytes, in.buffers);
  if (!decoded) return fail(decoded.error().code, decoded.error().to_string());
  const std::uint64_t held_tokens = in.held != nullptr ? in.held->info.layout.tokens : 0;
  if (decoded.value().header.layout.tokens + held_tokens != in.expected_tokens) {
    return fail(ErrorCode::kLayoutMismatch, "entry does not cover its blocks");
  }
  Fidelity fidelity = codec::fidelity_of(codec::frame_codec(in.codecs, decoded.value().header));
  if (!fidelity.is_exact()) fidelity.product = in.fidelity_product;
  if (!fidelity.is_exact() && in.lossless_requested) {
    return fail(ErrorCode::kUnknownCodec,
                fmt::format("wrong codec: asked for {}, got a {} frame", in.asked_codec, fidelity.lossy_codec));
  }
  const auto kv = std::as_bytes(decoded.value().kv);
  const auto decoded_at = MaterializeClock::now();
  const auto filed = [&]() -> Result<std::shared_ptr<const kv_store::StoredEntry>> {
    if (in.held != nullptr) {
      return join_entry(*in.held, decoded.value().header.layout, kv, fidelity, in.chain, in.buffers, in.arena);
    }
    KVRELAY_TRY(auto made, kv_store::make_stored_entry(decoded.value().header.layout, kv, in.arena));
    made->fidelity = fidelity;
    made->chain = in.chain;
    made->origin = kv_store::EntryOrigin::kFetched;
    return std::shared_ptr<const kv_store::StoredEntry>(std::move(made));
  }();
  if (!filed) return fail(filed.error().code, filed.error().to_string());
  return FrameEntry{std::move(filed).value(), kv.size(), decoded.value().header.layout.dtype,
                    seconds_between(started, decoded_at), seconds_between(decoded_at, MaterializeClock::now())};
}

Result<ServedEntry> entry_to_serve(ServeInputs in) {
  ServedEntry served;
  served.blocks = std::min(in.entry_blocks, in.max_blocks);
  served.entry = std::move(in.entry);
  // Also an entry the prefix index found: it holds more blocks than the prefix it stands for.
  if (in.block_tokens != 0 &&
      served.entry->info.layout.tokens > static_cast<std::uint64_t>(served.blocks) * in.block_tokens) {
    KVRELAY_TRY(
        served.entry,
        kv_store::slice_entry(*served.entry, static_cast<std::uint64_t>(served.blocks) * in.block_tokens, in.arena));
  }
  if (in.first_block > 0 && in.block_tokens != 0) {
    if (in.first_block >= served.blocks) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("span from block {} of an entry of {} servable blocks", in.first_block, served.blocks));
    }
    const TokenRun span{static_cast<std::uint32_t>(in.first_block * in.block_tokens),
                        static_cast<std::uint32_t>((served.blocks - in.first_block) * in.block_tokens)};
    KVRELAY_TRY(served.entry, kv_store::select_entry_tokens(*served.entry, std::span(&span, 1), in.arena));
    served.blocks -= in.first_block;
  }
  if (in.needs_round_trip) {
    const auto encode_started = MaterializeClock::now();
    KVRELAY_TRY(const auto frame, encode_entry(in.codecs, in.codec, *served.entry));
    const auto encoded_at = MaterializeClock::now();
    KVRELAY_TRY(served.entry, decode_entry(in.codecs, frame, in.max_bytes, in.arena));
    served.round_trip = CodecRoundTrip{frame.size(), seconds_between(encode_started, encoded_at),
                                       seconds_between(encoded_at, MaterializeClock::now())};
  }
  return served;
}

}  // namespace kvrelay::broker
