// Fuzzes the sidecar <-> sidecar TCP protocol's parsers as a peer's byte stream reaches them:
// frame headers, then each message's payload decoder (chunk headers included). Every decoded
// message must encode back to the bytes it came from, so a decoder can neither accept bytes it
// would not have produced nor lose a field; anything else must be a clean error.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "kvrelay/peer/peer_protocol.h"

namespace {

using namespace kvrelay::peer;

void require(bool condition) {
  if (!condition) std::abort();
}

std::span<const std::byte> payload_of(const std::vector<std::byte>& frame) {
  require(frame.size() >= kPeerHeaderBytes);
  return std::span<const std::byte>(frame).subspan(kPeerHeaderBytes);
}

bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

void check_payload(PeerMessage type, std::span<const std::byte> payload) {
  switch (type) {
    case PeerMessage::kHello:
    case PeerMessage::kHelloOk:
      if (auto hello = decode_hello(payload)) require(same(payload_of(encode_hello(type, hello.value())), payload));
      break;
    case PeerMessage::kChunk:
      if (payload.size() >= kChunkHeaderBytes) {
        const auto chunk = decode_chunk_header(payload.first<kChunkHeaderBytes>());
        std::array<std::byte, kChunkHeaderBytes> again{};
        encode_chunk_header(again, chunk);
        require(same(again, payload.first(kChunkHeaderBytes)));
      }
      break;
    case PeerMessage::kFetch:
      if (auto fetch = decode_fetch(payload)) require(same(payload_of(encode_fetch(fetch.value())), payload));
      break;
    case PeerMessage::kFetchReply: {
      std::uint64_t id = 0;  // the id the asker expects: take the reply's own
      if (payload.size() >= sizeof(id)) std::memcpy(&id, payload.data(), sizeof(id));
      if (auto reply = decode_fetch_reply(payload, id)) {
        const auto frame = encode_fetch_reply(id, reply.value() ? &*reply.value() : nullptr);
        require(same(payload_of(frame), payload));
      }
      break;
    }
    case PeerMessage::kPushEncoded:
      if (auto push = decode_push_encoded(payload))
        require(same(payload_of(encode_push_encoded(push.value())), payload));
      break;
    case PeerMessage::kSummaryReply:
      if (auto summary = decode_summary(payload)) {
        const auto& value = summary.value();
        require(same(payload_of(encode_summary(value.keys, value.node, value.products)), payload));
      }
      break;
    case PeerMessage::kProbe:
      if (auto bytes = decode_probe(payload)) require(same(payload_of(encode_probe(bytes.value())), payload));
      break;
    case PeerMessage::kStatsReply:
      if (auto stats = decode_peer_stats(payload)) require(same(payload_of(encode_peer_stats(stats.value())), payload));
      break;
    case PeerMessage::kChunkAck:
      if (auto ack = decode_chunk_ack(payload)) {
        require(same(payload_of(encode_chunk_ack(ack.value().id, ack.value().index)), payload));
      }
      break;
    case PeerMessage::kCommitted:
      if (auto id = decode_committed(payload)) require(same(payload_of(encode_committed(id.value())), payload));
      break;
    case PeerMessage::kError: {
      const auto error = decode_peer_error(payload);
      (void)encode_peer_error(error);
      break;
    }
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto stream = std::as_bytes(std::span(data, size));
  // The first frame is read as a hello is: another wire version's hello or error is accepted there.
  if (stream.size() >= kPeerHeaderBytes) {
    if (const auto first = decode_hello_header(stream.first<kPeerHeaderBytes>());
        first && first.value().version != kPeerVersion) {
      require(first.value().type == PeerMessage::kHello || first.value().type == PeerMessage::kHelloOk ||
              first.value().type == PeerMessage::kError);
      const kvrelay::Error refusal = wire_version_mismatch(first.value().version, "fuzz");
      const auto frame = encode_peer_error_for_version(refusal, first.value().version);
      require(decode_hello_header(std::span<const std::byte, kPeerHeaderBytes>(frame.data(), kPeerHeaderBytes))
                  .has_value());
      return 0;
    }
  }
  while (stream.size() >= kPeerHeaderBytes) {
    const auto header = decode_peer_header(stream.first<kPeerHeaderBytes>());
    if (!header) return 0;  // the receiver ends the session here
    const auto& value = header.value();
    require(value.version == kPeerVersion && known_peer_message(static_cast<std::uint16_t>(value.type)));
    const auto payload =
        stream.subspan(kPeerHeaderBytes, std::min<std::size_t>(value.length, stream.size() - kPeerHeaderBytes));
    check_payload(value.type, payload);
    stream = stream.subspan(kPeerHeaderBytes + payload.size());
  }
  return 0;
}
