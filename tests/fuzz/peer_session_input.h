#pragma once

// The input format of fuzz_peer_tls_session: what one fuzz input makes an authenticated peer send
// after the TLS handshake. A mutated byte stream alone almost never gets past a Hello, a valid
// Fetch or a chunk stream's running checksums, which a hostile peer with a certificate computes
// with ease; so the first byte picks a mode that writes those valid frames itself (with the
// protocol's own encoders) and the rest of the input is what the mode mutates.
//
//   byte 0:    mode = b % kSessionModes; bit (b / kSessionModes) & 1: the hello announces kCapFidelity
//   bytes 1-4: the mode's parameters p0..p3; the rest follows
//   kStream:     the hello, then the rest as it is (a frame stream)
//   kFetch:      the hello, a Fetch of the held chain (p0: codec, p1: skip_tokens, p2: which
//                hashes, p3 & 1: another model), then the rest (the seeds' ChunkAcks)
//   kPush:       the hello, then the rest as a KV frame (its trailer resealed unless p3 & 2)
//                pushed as a valid PushEncoded chunk stream (p0: chunk size, p1: window, p2:
//                route, p3 & 1: under the held key)
//   kPushStream: the hello, a PushEncoded header (p0-p1: frame bytes, p2: chunk size, p3:
//                route), then the rest as it is (the chunk frames)
//   kFirstFrame: the rest as it is, from the first frame (the hello parser)

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::fuzz {

enum class SessionMode : std::uint8_t { kStream, kFetch, kPush, kPushStream, kFirstFrame };
inline constexpr std::uint8_t kSessionModes = 5;
// Bytes after the mode byte that each mode reads as its parameters (missing ones read as 0).
inline constexpr std::size_t kModeParameterBytes = 4;

// The fixture's names: the server is node-a; the fuzzing client presents node-b's certificate,
// which node-a's policy names as peer node-b with one agent of the held entry's model.
inline constexpr std::string_view kServerNode = "node-a";
inline constexpr std::string_view kClientNode = "node-b";
// Routes kPush and kPushStream choose from: one the policy allows node-b to push on, one whose
// from agent lives here (refused), one the policy does not have, and none.
inline constexpr std::string_view kAllowedRoute = "b-to-a";
inline constexpr std::string_view kRoutes[] = {kAllowedRoute, "a-to-b", "no-such-route", ""};

// The one entry the server holds: KV of the agents' model, one block of tokens 0..15, filed
// under that chain's key (as a worker would file it, so that it may leave the node).
[[nodiscard]] KvLayout held_layout();
[[nodiscard]] kv_store::EntryChain held_chain();
[[nodiscard]] kv_store::EntryKey held_key();
// The codec specs kFetch chooses from (the last one is unknown).
inline constexpr std::string_view kFetchCodecs[] = {"raw",  "lossless", "fp8",       "int8",
                                                    "int4", "sparse",   "int4+zstd", "no-such-codec"};
inline constexpr std::uint64_t kFetchId = 7;    // kFetch's request id: a seed's ChunkAcks name it
inline constexpr std::uint64_t kPushId = 0x70;  // kPush's and kPushStream's transfer id

// Everything the client writes after the handshake for `input`.
[[nodiscard]] std::vector<std::byte> session_bytes(std::span<const std::uint8_t> input);

// An input of `mode` (the corpus generator's): the mode byte, `parameters` (at most
// kModeParameterBytes, padded with zeros) and `rest`.
[[nodiscard]] std::vector<std::uint8_t> session_input(SessionMode mode, bool fidelity,
                                                      std::span<const std::uint8_t> parameters,
                                                      std::span<const std::byte> rest);

}  // namespace kvrelay::fuzz
