// Writes the seed corpus of fuzz_peer_tls_session (peer_session_input.h) with the protocol's own
// encoders, so the seeds follow the wire format: the build runs it into the build tree (the
// replay test and a libFuzzer run read them there). Each mode gets its valid sessions (a fetch
// acknowledged to the end in every codec, pushes that are filed, duplicates and refusals) and
// broken ones. Usage: make_peer_session_corpus OUTPUT_DIR

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/codec_plugins/tensor_file.h"
#include "kvrelay/peer/peer_protocol.h"

#include "peer_session_input.h"

using namespace kvrelay;
using namespace kvrelay::peer;
using kvrelay::fuzz::SessionMode;

namespace {

std::vector<std::byte> frame(PeerMessage type, std::span<const std::byte> payload = {}) {
  return encode_peer_frame(type, payload);
}

std::vector<std::byte> join(std::initializer_list<std::vector<std::byte>> parts) {
  std::vector<std::byte> out;
  for (const auto& part : parts)
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

// Acknowledgements of a fetch reply's chunks 0..count-1, sent ahead: more than any held entry's
// reply has, so every codec's stream is acknowledged to its end (the rest end the session).
std::vector<std::byte> fetch_acks(std::uint32_t count) {
  std::vector<std::byte> out;
  for (std::uint32_t index = 0; index < count; ++index) {
    const auto ack = encode_chunk_ack(fuzz::kFetchId, index);
    out.insert(out.end(), ack.begin(), ack.end());
  }
  return out;
}

// The held entry's model's KV as a frame of `codec` (`tokens` of them), or another model's.
std::vector<std::byte> kv_frame(const codec::CodecRegistry& registry, const char* codec, std::uint64_t tokens,
                                std::uint32_t head_dim = fuzz::held_layout().head_dim) {
  auto layout = fuzz::held_layout();
  layout.tokens = tokens;
  layout.head_dim = head_dim;
  const auto spec = codec::resolve_codec(registry, codec).value();
  const auto kv = codec::synthetic_kv(layout, tokens).value();
  codec::EncodeOptions options;
  options.zstd_stage = spec.zstd_stage;
  const auto bytes = codec::encode_frame(*spec.codec, layout, kv, options).value();
  const auto* begin = reinterpret_cast<const std::byte*>(bytes.data());
  return {begin, begin + bytes.size()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_peer_session_corpus OUTPUT_DIR\n");
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::filesystem::remove_all(out);  // no seed of an older generator stays behind
  std::filesystem::create_directories(out);
  const auto registry = codec::CodecRegistry::with_builtins();
  int index = 0;
  const auto save = [&](const std::string& name, SessionMode mode, std::vector<std::uint8_t> parameters,
                        const std::vector<std::byte>& rest, bool fidelity = true) {
    char prefix[16];
    std::snprintf(prefix, sizeof prefix, "%03d-", index++);
    const auto input = fuzz::session_input(mode, fidelity, parameters, rest);
    if (!codec::write_binary_file(out / (prefix + name), input)) std::exit(1);
  };

  // kStream: the requests a session answers, and ones that end it.
  const std::vector<std::byte> ping_payload(8, std::byte{0x5A});
  save("stream-ping-stats-summary", SessionMode::kStream, {},
       join({frame(PeerMessage::kPing, ping_payload), frame(PeerMessage::kStats), frame(PeerMessage::kSummary)}));
  save("stream-oversized-ping", SessionMode::kStream, {},
       frame(PeerMessage::kPing, std::vector<std::byte>(65, std::byte{1})));
  save("stream-summary-with-payload", SessionMode::kStream, {}, frame(PeerMessage::kSummary, ping_payload));
  save("stream-unexpected-chunk-ack", SessionMode::kStream, {}, encode_chunk_ack(1, 0));
  save("stream-second-hello", SessionMode::kStream, {}, encode_hello(PeerMessage::kHello, Hello{}));
  save("stream-error", SessionMode::kStream, {}, encode_peer_error(Error{ErrorCode::kProtocol, "fuzz"}));
  save("stream-version-1-frame", SessionMode::kStream, {}, encode_peer_frame(PeerMessage::kPing, ping_payload, 1));
  const auto stats = frame(PeerMessage::kStats);
  save("stream-cut-header", SessionMode::kStream, {}, std::vector<std::byte>(stats.begin(), stats.begin() + 7));
  save("stream-empty", SessionMode::kStream, {}, {}, false);

  // kFetch: every codec, acknowledged to the end; a skip within and past the entry; other chains.
  for (std::uint8_t codec = 0; codec < std::size(fuzz::kFetchCodecs); ++codec) {
    save("fetch-" + std::string(fuzz::kFetchCodecs[codec]), SessionMode::kFetch, {codec, 0, 0, 0}, fetch_acks(64));
  }
  save("fetch-raw-skip-4", SessionMode::kFetch, {0, 4, 0, 0}, fetch_acks(64));
  save("fetch-int4-skip-past-entry", SessionMode::kFetch, {4, 16, 0, 0}, fetch_acks(2));
  save("fetch-held-as-prefix", SessionMode::kFetch, {0, 0, 1, 0}, fetch_acks(64));
  save("fetch-held-not-a-prefix", SessionMode::kFetch, {0, 0, 2, 0}, fetch_acks(2));
  save("fetch-no-hashes", SessionMode::kFetch, {0, 0, 3, 0}, {});
  save("fetch-other-model", SessionMode::kFetch, {0, 0, 0, 1}, {});
  save("fetch-raw-unacknowledged", SessionMode::kFetch, {0, 0, 0, 0}, frame(PeerMessage::kStats), false);
  save("fetch-ack-out-of-order", SessionMode::kFetch, {0, 0, 0, 0}, encode_chunk_ack(fuzz::kFetchId, 5));
  save("fetch-ack-other-id", SessionMode::kFetch, {0, 0, 0, 0}, encode_chunk_ack(fuzz::kFetchId + 1, 0));

  // kPush: frames that are filed (p0: chunk size 16 << p0, p1: window, p2: route, p3: key), a
  // duplicate of the held entry, refusals, and frames the decoder refuses.
  const auto raw = kv_frame(registry, "raw", 16);
  save("push-raw", SessionMode::kPush, {4, 1, 0, 0}, raw);
  save("push-raw-unverified-sender", SessionMode::kPush, {4, 1, 0, 0}, raw, false);
  save("push-raw-one-chunk", SessionMode::kPush, {9, 7, 0, 0}, raw);
  save("push-raw-held-key", SessionMode::kPush, {5, 3, 0, 1}, raw);
  save("push-int4-held-key", SessionMode::kPush, {3, 0, 0, 1}, kv_frame(registry, "int4", 16));
  save("push-lossless", SessionMode::kPush, {2, 2, 0, 0}, kv_frame(registry, "lossless", 16));
  save("push-int8-zstd", SessionMode::kPush, {0, 4, 0, 0}, kv_frame(registry, "int8+zstd", 8));
  save("push-fp8", SessionMode::kPush, {6, 5, 0, 0}, kv_frame(registry, "fp8", 3));
  save("push-sparse", SessionMode::kPush, {6, 5, 0, 0}, kv_frame(registry, "sparse", 12));
  save("push-route-from-here", SessionMode::kPush, {4, 1, 1, 0}, raw);
  save("push-unknown-route", SessionMode::kPush, {4, 1, 2, 0}, raw);
  save("push-no-route", SessionMode::kPush, {4, 1, 3, 0}, raw);
  save("push-other-model", SessionMode::kPush, {4, 1, 0, 0}, kv_frame(registry, "raw", 4, 16));
  save("push-trailer-not-resealed", SessionMode::kPush, {4, 1, 0, 2},
       std::vector<std::byte>(raw.begin(), raw.end() - 1));
  save("push-empty-frame", SessionMode::kPush, {0, 0, 0, 0}, {});

  // kPushStream: a header (p0-p1: frame bytes) and chunks the fuzzer makes.
  {
    std::vector<std::byte> payload(kChunkHeaderBytes + 32, std::byte{3});
    encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(payload.data(), kChunkHeaderBytes),
                        ChunkHeader{fuzz::kPushId, 0, 0x1234});
    save("push-stream-bad-checksum", SessionMode::kPushStream, {32, 0, 1, 0}, frame(PeerMessage::kChunk, payload));
    encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(payload.data(), kChunkHeaderBytes),
                        ChunkHeader{fuzz::kPushId, 1, 0x1234});
    save("push-stream-chunk-out-of-order", SessionMode::kPushStream, {32, 0, 1, 0},
         frame(PeerMessage::kChunk, payload));
  }
  save("push-stream-ping-instead", SessionMode::kPushStream, {64, 0, 1, 0}, frame(PeerMessage::kPing));
  save("push-stream-refused-route", SessionMode::kPushStream, {64, 0, 1, 1}, {});

  // kFirstFrame: what the hello parser sees.
  Hello hello;
  hello.node_id = std::string(fuzz::kClientNode);
  hello.capabilities = kCapFidelity | kCapSharedMemory;
  hello.shm_socket = "/tmp/kvrelay-fuzz.sock";
  save("first-hello-shm", SessionMode::kFirstFrame, {},
       join({encode_hello(PeerMessage::kHello, hello), frame(PeerMessage::kPing, ping_payload)}));
  hello.node_id = "node-c";  // a node its certificate does not name
  save("first-hello-other-node", SessionMode::kFirstFrame, {}, encode_hello(PeerMessage::kHello, hello));
  save("first-hello-ok", SessionMode::kFirstFrame, {}, encode_hello(PeerMessage::kHelloOk, hello));
  save("first-ping", SessionMode::kFirstFrame, {}, frame(PeerMessage::kPing, ping_payload));
  const auto hello_frame = encode_hello(PeerMessage::kHello, hello);
  const auto hello_payload = std::span(hello_frame).subspan(kPeerHeaderBytes);
  save("first-hello-version-1", SessionMode::kFirstFrame, {}, encode_peer_frame(PeerMessage::kHello, hello_payload, 1));
  save("first-garbage", SessionMode::kFirstFrame, {}, std::vector<std::byte>(40, std::byte{0xFF}));
  return 0;
}
