#include "kv_media.h"

#include <fmt/format.h>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/decision/media.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/memfd.h"

namespace kvrelay::broker {

namespace {

std::span<const std::uint8_t> as_u8(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
}

}  // namespace

std::optional<std::string> codec_for_medium(std::string_view medium) {
  return decision::prefix_codec_for(medium);
}

std::string medium_for_codec(std::string_view codec) {
  return decision::medium_for_codec_spec(codec);
}

Result<std::shared_ptr<const kv_store::StoredEntry>> join_entry(const kv_store::StoredEntry& head,
                                                                const KvLayout& tail_layout,
                                                                std::span<const std::byte> tail,
                                                                const Fidelity& tail_fidelity,
                                                                std::shared_ptr<const kv_store::EntryChain> chain,
                                                                WarmBufferPool& buffers, kv_store::ShmArena* arena) {
  if (head.info.layout.layers == 0 || tail_layout.layers == 0) {
    return fail(ErrorCode::kLayoutMismatch, "cannot join opaque entries");
  }
  KVRELAY_TRY(const std::uint64_t tokens, checked_add(head.info.layout.tokens, tail_layout.tokens));
  const KvLayout joined = head.info.layout.with_tokens(tokens);
  KVRELAY_TRY(const std::uint64_t total, joined.total_bytes());
  auto head_bytes = buffers.take(static_cast<std::size_t>(head.info.bytes));
  KVRELAY_TRY(kv_store::read_entry(head, 0, head_bytes.bytes()));
  auto bytes = buffers.take(static_cast<std::size_t>(total));
  KVRELAY_TRY(join_tokens(head.info.layout, head_bytes.bytes(), tail_layout, tail, bytes.bytes()));
  KVRELAY_TRY(auto stored, kv_store::make_stored_entry(joined, bytes.bytes(), arena));
  stored->fidelity = head.fidelity.then(tail_fidelity, head.info.layout.tokens);
  stored->chain = std::move(chain);
  stored->origin = kv_store::EntryOrigin::kFetched;  // a held prefix joined with a fetched delta
  return std::shared_ptr<const kv_store::StoredEntry>(std::move(stored));
}

Result<std::vector<std::uint8_t>> encode_entry(const codec::CodecRegistry& codecs, std::string_view codec_spec,
                                               const kv_store::StoredEntry& entry) {
  KVRELAY_TRY(const auto spec, codec::resolve_codec(codecs, codec_spec));
  KVRELAY_TRY(const auto view, kv_store::view_entry(entry));
  codec::EncodeOptions options;
  options.zstd_stage = spec.zstd_stage;
  return codec::encode_frame(*spec.codec, entry.info.layout, as_u8(view.bytes()), options);
}

Result<std::shared_ptr<const kv_store::StoredEntry>> decode_entry(const codec::CodecRegistry& codecs,
                                                                  std::span<const std::uint8_t> frame,
                                                                  std::uint64_t max_bytes, kv_store::ShmArena* arena) {
  KVRELAY_TRY(const auto header, codec::inspect_frame(frame));
  KVRELAY_TRY(const auto raw, codec::decode_frame(codecs, frame, max_bytes));
  KVRELAY_TRY(auto stored, kv_store::make_stored_entry(header.layout, std::as_bytes(std::span(raw)), arena));
  stored->fidelity = codec::fidelity_of(codec::frame_codec(codecs, header));
  return std::shared_ptr<const kv_store::StoredEntry>(std::move(stored));
}

}  // namespace kvrelay::broker
