// Writes the fuzz_peer_frames seed corpus (tests/fuzz/corpus/peer_frames) with the protocol's own
// encoders, so the seeds follow the wire version: valid streams of every message, and the broken
// variants each decoder must refuse. Run it after a wire change:
//   build/default/tests/fuzz/make_peer_frames_corpus tests/fuzz/corpus/peer_frames
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/peer/peer_protocol.h"

namespace {

using namespace kvrelay;
using namespace kvrelay::peer;
using Bytes = std::vector<std::byte>;

Bytes header_bytes(std::uint32_t magic, std::uint16_t version, std::uint16_t type, std::uint32_t length) {
  Bytes out(kPeerHeaderBytes);
  std::memcpy(out.data(), &magic, 4);
  std::memcpy(out.data() + 4, &version, 2);
  std::memcpy(out.data() + 6, &type, 2);
  std::memcpy(out.data() + 8, &length, 4);
  return out;
}

Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const auto& part : parts)
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

// A chunk frame of `bytes` 0xAB bytes for stream `id` (its checksum is not checked by the decoders).
Bytes chunk(std::uint64_t id, std::uint32_t index, std::size_t bytes) {
  Bytes payload(kChunkHeaderBytes + bytes, std::byte{0xAB});
  encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(payload.data(), kChunkHeaderBytes), {id, index, 0});
  return encode_peer_frame(PeerMessage::kChunk, payload);
}

EncodedEntryHeader entry_header(std::uint64_t id) {
  EncodedEntryHeader header;
  header.id = id;
  header.key = {7, 0x1234};
  header.frame_bytes = 100;
  header.chunk_bytes = 64;
  header.window_chunks = 8;
  header.chain.block_tokens = 2;
  header.chain.root = 0x1122334455667788ULL;
  header.chain.tokens = {1, 2, 3, 4};
  header.fidelity_product = 0.9;
  return header;
}

// The frame with the 8 bytes at `from_end` bytes before its end replaced by `bits`.
Bytes patch_tail_u64(Bytes frame, std::size_t from_end, std::uint64_t bits) {
  std::memcpy(frame.data() + frame.size() - from_end, &bits, 8);
  return frame;
}

void write(const std::filesystem::path& dir, const std::string& name, const Bytes& bytes) {
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  for (const auto& old : std::filesystem::directory_iterator(dir))
    std::filesystem::remove(old.path());

  Hello hello;
  hello.capabilities = kCapFidelity;
  hello.node_id = "node-a";
  write(dir, "hello.bin", encode_hello(PeerMessage::kHello, hello));
  Hello ok = hello;
  ok.node_id = "node-b";
  ok.capabilities |= kCapSharedMemory;
  ok.shm_socket = "/tmp/k.sock";
  write(dir, "hello_ok.bin", encode_hello(PeerMessage::kHelloOk, ok));
  // Older wire versions' hellos (3 has the same layout as 4) and a version 1 error.
  for (const std::uint16_t version : {std::uint16_t{1}, std::uint16_t{3}}) {
    ByteWriter old;
    old.put(std::uint32_t{version}).put(std::uint64_t{1}).put_string("old").put(std::uint32_t{1U << 20});
    old.put_string("");
    write(dir, "hello_v" + std::to_string(version) + ".bin",
          cat({header_bytes(kPeerMagic, version, 1, static_cast<std::uint32_t>(old.size())), old.bytes()}));
  }
  write(dir, "error_v1.bin",
        encode_peer_error_for_version(Error{ErrorCode::kBadVersion, "peer protocol version 2"}, 1));
  write(dir, "error.bin", encode_peer_error(Error{ErrorCode::kNotFound, "no"}));
  write(dir, "bad_magic.bin", header_bytes(0x5852564BU, kPeerVersion, 9, 0));
  write(dir, "oversized.bin", header_bytes(kPeerMagic, kPeerVersion, 9, 0x40000000U));
  write(dir, "unknown_type.bin", header_bytes(kPeerMagic, kPeerVersion, 99, 0));
  write(dir, "retired_begin.bin", cat({header_bytes(kPeerMagic, kPeerVersion, 3, 40), Bytes(40)}));
  const Bytes nonce{std::byte{'1'}, std::byte{'2'}, std::byte{'3'}, std::byte{'4'},
                    std::byte{'5'}, std::byte{'6'}, std::byte{'7'}, std::byte{'8'}};
  write(dir, "ping_pong.bin",
        cat({encode_peer_frame(PeerMessage::kPing, nonce), encode_peer_frame(PeerMessage::kPong, nonce)}));
  PeerServerStats stats;
  stats.sessions = 1;
  stats.committed_transfers = 3;
  stats.bytes_received = 1U << 20;
  stats.chunks_received = 2;
  stats.fetches_served = 4;
  write(dir, "stats.bin", cat({encode_peer_frame(PeerMessage::kStats, {}), encode_peer_stats(stats)}));
  write(dir, "chunk_ack.bin", encode_chunk_ack(3, 7));
  write(dir, "committed.bin", encode_committed(3));

  // Fetch: a full one, a delta with a route, deadline and least product, and broken ones.
  FetchRequest fetch{1, 7, "raw", {0x1234, 0x99}};
  write(dir, "fetch.bin", encode_fetch(fetch));
  FetchRequest delta{2, 7, "int8", {0x1234}, 64, "planner-to-coder", 1500, 0.8};
  write(dir, "fetch_delta_route.bin", encode_fetch(delta));
  write(dir, "fetch_min_product_nan.bin",
        patch_tail_u64(encode_fetch(delta), 8, std::bit_cast<std::uint64_t>(std::numeric_limits<double>::quiet_NaN())));
  write(dir, "fetch_min_product_above_one.bin",
        patch_tail_u64(encode_fetch(delta), 8, std::bit_cast<std::uint64_t>(1.5)));
  FetchRequest long_route = fetch;
  long_route.route.assign(kMaxRouteBytes + 1, 'r');
  write(dir, "fetch_route_too_long.bin", encode_fetch(long_route));
  {
    ByteWriter past_end;  // a codec string that claims more bytes than follow
    past_end.put(std::uint64_t{5}).put(std::uint64_t{1}).put(std::uint16_t{200}).put(std::uint32_t{0});
    write(dir, "fetch_codec_past_end.bin", encode_peer_frame(PeerMessage::kFetch, past_end.bytes()));
  }
  {
    auto v3 = encode_fetch(fetch);  // what a version 3 fetch was: no route, deadline or product
    v3.resize(v3.size() - (2 + 4 + 8));
    const auto length = static_cast<std::uint32_t>(v3.size() - kPeerHeaderBytes);
    std::memcpy(v3.data() + 8, &length, 4);
    write(dir, "fetch_v3_layout.bin", v3);
  }

  // FetchReply: a miss, and a hit followed by its chunks.
  write(dir, "fetch_miss.bin", encode_fetch_reply(1, nullptr));
  auto reply = entry_header(1);
  write(dir, "fetch_reply.bin", cat({encode_fetch_reply(1, &reply), chunk(1, 0, 64), chunk(1, 1, 36)}));
  write(dir, "fetch_reply_product_zero.bin", patch_tail_u64(encode_fetch_reply(1, &reply), 8, 0));

  // PushEncoded: a push, a spill delta, and broken ones.
  auto push = entry_header(9);
  push.route = "a-to-b";
  write(dir, "push_encoded.bin", cat({encode_push_encoded(push), chunk(9, 0, 64), chunk(9, 1, 36)}));
  auto spill = push;
  spill.route.clear();
  spill.purpose = PushPurpose::kSpill;
  spill.skip_tokens = 2;
  spill.fidelity_product = 1.0;
  write(dir, "push_spill_delta.bin", encode_push_encoded(spill));
  {
    auto bad_purpose = encode_push_encoded(push);
    bad_purpose[bad_purpose.size() - 17] = std::byte{7};  // purpose, before skip_tokens and the product
    write(dir, "push_purpose_unknown.bin", bad_purpose);
  }
  write(dir, "push_product_negative.bin",
        patch_tail_u64(encode_push_encoded(push), 8, std::bit_cast<std::uint64_t>(-0.5)));
  auto window_zero = push;
  window_zero.window_chunks = 0;
  write(dir, "push_window_zero.bin", encode_push_encoded(window_zero));

  // Summary v2: node state and keys; a count that lies.
  NodeState node{1U << 30, 1U << 20, 256U << 20, 64U << 20, 2, 0, 1'000'000'000, 4096};
  const std::vector<kv_store::EntryKey> keys{{1, 1}, {1, 2}};
  write(dir, "summary.bin", cat({encode_peer_frame(PeerMessage::kSummary, {}), encode_summary(keys, node)}));
  {
    auto lying = encode_summary(keys, node);
    const std::uint32_t count = 3;
    std::memcpy(lying.data() + kPeerHeaderBytes + kNodeStateBytes, &count, 4);
    write(dir, "summary_count_lies.bin", lying);
  }
  {
    auto short_state = encode_summary({}, node);  // cut inside the node state
    short_state.resize(kPeerHeaderBytes + 20);
    const std::uint32_t length = 20;
    std::memcpy(short_state.data() + 8, &length, 4);
    write(dir, "summary_state_truncated.bin", short_state);
  }
  // Bandwidth probes (version 5): in range, and past kMaxProbeBytes.
  write(dir, "probe.bin", encode_probe(kMaxProbeBytes));
  write(dir, "probe_too_large.bin", encode_probe(kMaxProbeBytes + 1));
  write(dir, "probe_reply.bin", encode_peer_frame(PeerMessage::kProbeReply, std::vector<std::byte>(64)));
  return 0;
}
