// fuzz_peer_tls_session's modes reach what they are for: a fetch served to its last chunk, pushes
// filed (and a lossy one kept out by exact KV), and refusals of a push by route and by model, on
// the real PeerServer behind its TLS handshake (peer_tls_harness.h).
#include <catch2/catch.hpp>

#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/peer/peer_protocol.h"

#include "peer_session_input.h"
#include "peer_tls_harness.h"

namespace kvrelay::test {

namespace {

using fuzz::SessionMode;

peer::PeerServerStats session(SessionMode mode, const std::vector<std::uint8_t>& parameters,
                              const std::vector<std::byte>& rest) {
  auto& server = fuzz::TlsSessionServer::instance();
  server.reset_store();
  fuzz::TlsSessionClient client(server);
  REQUIRE(client.handshake(std::chrono::seconds(30)));
  const auto input = fuzz::session_input(mode, true, parameters, rest);
  REQUIRE(client.exchange(fuzz::session_bytes(input), std::chrono::seconds(30)));
  return server.stats();
}

std::vector<std::byte> pushed_frame(const char* codec_spec, std::uint32_t head_dim) {
  auto layout = fuzz::held_layout();
  layout.head_dim = head_dim;
  const auto registry = codec::CodecRegistry::with_builtins();
  const auto spec = codec::resolve_codec(registry, codec_spec).value();
  const auto kv = codec::synthetic_kv(layout, 3).value();
  const auto frame = codec::encode_frame(*spec.codec, layout, kv).value();
  const auto* bytes = reinterpret_cast<const std::byte*>(frame.data());
  return {bytes, bytes + frame.size()};
}

}  // namespace

TEST_CASE("the TLS session fuzz modes reach a served fetch, filed pushes and refusals", "[fuzz]") {
  const auto before = fuzz::TlsSessionServer::instance().stats();
  const auto held_dim = fuzz::held_layout().head_dim;

  std::vector<std::byte> acks;
  for (std::uint32_t index = 0; index < 64; ++index) {
    const auto ack = peer::encode_chunk_ack(fuzz::kFetchId, index);
    acks.insert(acks.end(), ack.begin(), ack.end());
  }
  const auto fetched = session(SessionMode::kFetch, {0, 0, 0, 0}, acks);
  CHECK(fetched.fetches_served == before.fetches_served + 1);

  // Chunks of 16 << 4 bytes, a window of 2, route b-to-a: filed.
  const auto pushed = session(SessionMode::kPush, {4, 1, 0, 0}, pushed_frame("raw", held_dim));
  CHECK(pushed.committed_transfers == fetched.committed_transfers + 1);
  CHECK(pushed.duplicate_transfers == fetched.duplicate_transfers);

  // Lossy KV under the held (exact) entry's key: received, and the exact entry kept.
  const auto lossy = session(SessionMode::kPush, {4, 1, 0, 1}, pushed_frame("int4", held_dim));
  CHECK(lossy.committed_transfers == pushed.committed_transfers + 1);
  CHECK(lossy.duplicate_transfers == pushed.duplicate_transfers + 1);

  // Route a-to-b: refused before a chunk is read, so no transfer started.
  const auto refused = session(SessionMode::kPush, {4, 1, 1, 0}, pushed_frame("raw", held_dim));
  CHECK(refused.committed_transfers == lossy.committed_transfers);
  CHECK(refused.failed_transfers == lossy.failed_transfers);

  // Another model's KV on an allowed route: received and decoded, never filed.
  const auto other_model = session(SessionMode::kPush, {4, 1, 0, 0}, pushed_frame("raw", 2 * held_dim));
  CHECK(other_model.committed_transfers == refused.committed_transfers);
  CHECK(other_model.failed_transfers == refused.failed_transfers + 1);
}

}  // namespace kvrelay::test
