#include "peer_session_input.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/peer/peer_protocol.h"

namespace kvrelay::fuzz {

namespace {

using namespace kvrelay::peer;

void append(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

// 16 B .. 8 KiB: small enough that a fuzzed frame spans several chunks.
std::uint32_t chunk_size(std::uint8_t selector) {
  return 16U << (selector % 10U);
}

std::string route(std::uint8_t selector) {
  return std::string(kRoutes[selector % std::size(kRoutes)]);
}

std::vector<std::byte> hello(bool fidelity) {
  Hello mine;
  mine.node_id = std::string(kClientNode);
  mine.capabilities = fidelity ? kCapFidelity : 0;
  return encode_hello(PeerMessage::kHello, mine);
}

std::vector<std::byte> fetch(const std::array<std::uint8_t, kModeParameterBytes>& p) {
  const auto held = held_key();
  FetchRequest request;
  request.request_id = kFetchId;
  request.model_id = (p[3] & 1U) != 0 ? held.model_id + 1 : held.model_id;
  request.codec = std::string(kFetchCodecs[p[0] % std::size(kFetchCodecs)]);
  request.skip_tokens = p[1];
  const std::uint64_t other = held.context_hash ^ 0xFFU;
  switch (p[2] % 4U) {
    case 0:  // the held chain
      request.hashes = {held.context_hash};
      break;
    case 1:  // a longer chain, the held one its prefix
      request.hashes = {other, held.context_hash};
      break;
    case 2:  // the held hash as a second block, after one this node does not hold
      request.hashes = {held.context_hash, other};
      break;
    default:  // no hashes at all
      break;
  }
  return encode_fetch(request);
}

// What an authenticated sender writes for `frame`: the PushEncoded, then every chunk with its
// running checksum (peer_protocol.h), without waiting for acknowledgements.
std::vector<std::byte> push(const std::array<std::uint8_t, kModeParameterBytes>& p, std::vector<std::byte> frame) {
  if ((p[3] & 2U) == 0 && frame.size() >= codec::kFrameTrailerSize) {
    const std::size_t body = frame.size() - codec::kFrameTrailerSize;
    const std::uint64_t checksum = bulk_hash64(frame.data(), body);
    std::memcpy(frame.data() + body, &checksum, sizeof checksum);
  }
  // The held chain (bit 0), else the same tokens under another root: a key of its own. Bit 7
  // changes a token id, so the receiver's chain check refuses the push.
  const auto held = held_key();
  EncodedEntryHeader header;
  header.id = kPushId;
  header.chain = held_chain();
  if ((p[3] & 1U) == 0) header.chain.root = kRootBlockHash + p[3] + 1;
  header.key = {held.model_id,
                kv_store::chain_keys(held.model_id, header.chain, kv_store::ChainScope::kUnscoped).back()};
  if ((p[3] & 0x80U) != 0) header.chain.tokens.front() ^= 1U;
  header.frame_bytes = frame.size();
  header.chunk_bytes = chunk_size(p[0]);
  header.window_chunks = 1U + p[1] % 8U;
  header.route = route(p[2]);
  std::vector<std::byte> out = encode_push_encoded(header);
  BulkHashStream running;
  const auto stream_header = stream_header_bytes(header);
  running.update(stream_header.data(), stream_header.size());
  for (std::uint64_t index = 0; index < header.chunk_count(); ++index) {
    const std::size_t offset = index * header.chunk_bytes;
    const std::size_t length = std::min<std::size_t>(header.chunk_bytes, frame.size() - offset);
    const auto body = std::span<const std::byte>(frame).subspan(offset, length);
    running.update(body.data(), body.size());
    std::vector<std::byte> payload(kChunkHeaderBytes);
    encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(payload.data(), kChunkHeaderBytes),
                        ChunkHeader{header.id, static_cast<std::uint32_t>(index), running.digest()});
    append(payload, body);
    append(out, encode_peer_frame(PeerMessage::kChunk, payload));
  }
  return out;
}

std::vector<std::byte> push_header(const std::array<std::uint8_t, kModeParameterBytes>& p) {
  EncodedEntryHeader header;
  header.id = kPushId;
  header.key = kv_store::EntryKey{held_key().model_id, held_key().context_hash + 1};
  header.frame_bytes = p[0] | (std::uint64_t{p[1]} << 8U);
  header.chunk_bytes = chunk_size(p[2]);
  header.window_chunks = 2;
  header.route = route(p[3]);
  return encode_push_encoded(header);
}

}  // namespace

KvLayout held_layout() {
  return KvLayout{2, 2, 8, DType::kFloat16, kDefaultBlockTokens};
}

kv_store::EntryChain held_chain() {
  kv_store::EntryChain chain;
  for (TokenId token = 0; token < held_layout().tokens; ++token)
    chain.tokens.push_back(token);
  return chain;
}

kv_store::EntryKey held_key() {
  constexpr std::uint64_t kModel = 0x66757A7A6D6F646CULL;  // "fuzzmodl"
  return {kModel, kv_store::chain_keys(kModel, held_chain(), kv_store::ChainScope::kUnscoped).back()};
}

std::vector<std::byte> session_bytes(std::span<const std::uint8_t> input) {
  const std::uint8_t selector = input.empty() ? 0 : input[0];  // an empty input reads as zeros
  const auto mode = static_cast<SessionMode>(selector % kSessionModes);
  const bool fidelity = ((selector / kSessionModes) & 1U) != 0;
  std::array<std::uint8_t, kModeParameterBytes> p{};
  const auto after_mode = input.empty() ? input : input.subspan(1);
  const auto parameters = after_mode.first(std::min(kModeParameterBytes, after_mode.size()));
  std::copy(parameters.begin(), parameters.end(), p.begin());
  const auto rest = std::as_bytes(after_mode.subspan(parameters.size()));
  std::vector<std::byte> out;
  if (mode != SessionMode::kFirstFrame) out = hello(fidelity);
  switch (mode) {
    case SessionMode::kFetch:
      append(out, fetch(p));
      break;
    case SessionMode::kPush:
      append(out, push(p, std::vector<std::byte>(rest.begin(), rest.end())));
      return out;
    case SessionMode::kPushStream:
      append(out, push_header(p));
      break;
    case SessionMode::kStream:
    case SessionMode::kFirstFrame:
      break;
  }
  append(out, rest);
  return out;
}

std::vector<std::uint8_t> session_input(SessionMode mode, bool fidelity, std::span<const std::uint8_t> parameters,
                                        std::span<const std::byte> rest) {
  // Sized once, then filled: GCC 12 at -O2 misreads inserts into a short vector as out of bounds.
  std::vector<std::uint8_t> out(1 + kModeParameterBytes + rest.size(), 0);
  out[0] = static_cast<std::uint8_t>(static_cast<std::uint8_t>(mode) + (fidelity ? kSessionModes : 0));
  const auto used = parameters.first(std::min(parameters.size(), kModeParameterBytes));
  std::copy(used.begin(), used.end(), out.begin() + 1);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(rest.data());
  std::copy(bytes, bytes + rest.size(), out.begin() + static_cast<std::ptrdiff_t>(1 + kModeParameterBytes));
  return out;
}

}  // namespace kvrelay::fuzz
