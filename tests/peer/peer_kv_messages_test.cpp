// Peer-plane KV path messages (Fetch, FetchReply, PushEncoded, Summary): round trips, and every
// truncated or lying payload refused.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <array>
#include <cstring>
#include <limits>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/peer/peer_protocol.h"

using namespace kvrelay;
using namespace kvrelay::peer;

namespace {

std::vector<std::byte> payload_of(const std::vector<std::byte>& frame) {
  return {frame.begin() + static_cast<std::ptrdiff_t>(kPeerHeaderBytes), frame.end()};
}

}  // namespace

TEST_CASE("fetch requests round-trip, truncated or lying ones are refused", "[proxy][peer][unit]") {
  const FetchRequest request{42, 7, "int4+zstd", {9, 8, 7}};
  const auto payload = payload_of(encode_fetch(request));
  const auto decoded = decode_fetch(payload);
  REQUIRE(decoded);
  CHECK(decoded.value().codec == "int4+zstd");
  CHECK(decoded.value().hashes == std::vector<std::uint64_t>{9, 8, 7});
  for (std::size_t length = 0; length < payload.size(); ++length) {
    CHECK_FALSE(decode_fetch(std::span(payload.data(), length)));
  }
  CHECK_FALSE(decode_fetch(payload_of(encode_fetch({1, 7, "", {1}}))));  // no codec named
  CHECK(decoded.value().skip_tokens == 0);
}

TEST_CASE("a delta fetch carries the tokens the asker already holds", "[proxy][peer][unit]") {
  const FetchRequest request{43, 7, "raw", {9, 8}, 96};
  const auto payload = payload_of(encode_fetch(request));
  const auto decoded = decode_fetch(payload);
  REQUIRE(decoded);
  CHECK(decoded.value().skip_tokens == 96);
  CHECK(decoded.value().hashes == std::vector<std::uint64_t>{9, 8});
}

TEST_CASE("wire v4 fetches carry a route, a deadline and the least fidelity product", "[proxy][peer][unit]") {
  const FetchRequest request{44, 7, "int8", {9, 8}, 32, "planner-to-coder", 1500, 0.81};
  const auto payload = payload_of(encode_fetch(request));
  const auto decoded = decode_fetch(payload);
  REQUIRE(decoded);
  CHECK(decoded.value().route == "planner-to-coder");
  CHECK(decoded.value().deadline_ms == 1500);
  CHECK(decoded.value().min_fidelity_product == 0.81);
  CHECK(decoded.value().skip_tokens == 32);
  // Defaults: no route, no deadline, any product.
  const auto plain = decode_fetch(payload_of(encode_fetch({1, 7, "raw", {1}})));
  REQUIRE(plain);
  CHECK(plain.value().route.empty());
  CHECK(plain.value().deadline_ms == 0);
  CHECK(plain.value().min_fidelity_product == 0.0);
  // Every cut is refused, and so is a trailing byte.
  for (std::size_t length = 0; length < payload.size(); ++length) {
    CHECK_FALSE(decode_fetch(std::span(payload.data(), length)));
  }
  auto longer = payload;
  longer.push_back(std::byte{0});
  CHECK(decode_fetch(longer).error().code == ErrorCode::kProtocol);
  // A product that is NaN, negative (-0 too) or above 1 is refused by name.
  for (const double bad :
       {std::numeric_limits<double>::quiet_NaN(), -0.0, -0.5, 1.0000001, std::numeric_limits<double>::infinity()}) {
    auto lying = request;
    lying.min_fidelity_product = bad;
    const auto refused = decode_fetch(payload_of(encode_fetch(lying)));
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kProtocol);
    CHECK_THAT(refused.error().message, Catch::Contains("min_fidelity_product"));
  }
  for (const double edge : {0.0, 1.0}) {
    auto fine = request;
    fine.min_fidelity_product = edge;
    CHECK(decode_fetch(payload_of(encode_fetch(fine))));
  }
  // A route is bounded.
  auto long_route = request;
  long_route.route.assign(kMaxRouteBytes, 'r');
  CHECK(decode_fetch(payload_of(encode_fetch(long_route))));
  long_route.route.push_back('r');
  const auto too_long = decode_fetch(payload_of(encode_fetch(long_route)));
  REQUIRE_FALSE(too_long);
  CHECK_THAT(too_long.error().message, Catch::Contains("route of 257 bytes"));
  // A hash count past what follows is refused before anything is reserved for it.
  auto huge = payload;
  const std::uint32_t count = 1U << 30;
  std::memcpy(huge.data() + 8 + 8 + 2 + 4, &count, sizeof(count));
  CHECK(decode_fetch(huge).error().code == ErrorCode::kProtocol);
}

TEST_CASE("fetch replies and pushes check their ids, sizes and chunking", "[proxy][peer][unit]") {
  EncodedEntryHeader header;
  header.id = 5;
  header.key = {1, 2};
  header.frame_bytes = 3 * 1024 * 1024 + 1;
  header.chunk_bytes = 1U << 20;
  header.window_chunks = 6;
  CHECK(header.chunk_count() == 4);
  CHECK(header.ack_every() == 3);

  const auto found = decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 5);
  REQUIRE(found);
  REQUIRE(found.value());
  CHECK(found.value()->frame_bytes == header.frame_bytes);
  CHECK_FALSE(decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 6));  // another request's reply
  const auto miss = decode_fetch_reply(payload_of(encode_fetch_reply(5, nullptr)), 5);
  REQUIRE(miss);
  CHECK_FALSE(miss.value());

  header.chain.block_tokens = 2;
  header.chain.root = 0x1122334455667788ULL;
  header.chain.tenant = "acme";
  header.chain.tokens = {7, 8, 9, 10};
  header.route = "a-to-b";
  const auto pushed = decode_push_encoded(payload_of(encode_push_encoded(header)));
  REQUIRE(pushed);
  CHECK(pushed.value().key == header.key);
  CHECK(pushed.value().window_chunks == 6);
  CHECK(pushed.value().chain == header.chain);
  CHECK(pushed.value().route == "a-to-b");
  CHECK(found.value()->chain.tokens.empty());  // encoded before the chain was set
  {
    const auto with_chain = decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 5);
    REQUIRE(with_chain);
    CHECK(with_chain.value()->chain == header.chain);
  }
  {
    auto partial = header;  // token ids that are not whole blocks
    partial.chain.tokens.push_back(11);
    CHECK(decode_push_encoded(payload_of(encode_push_encoded(partial))).error().code == ErrorCode::kProtocol);
    auto too_many = header;  // a count past kMaxChainTokens is refused before anything is read
    too_many.chain.block_tokens = 1;
    too_many.chain.tokens.assign(kv_store::kMaxChainTokens + 1, 0);
    const auto refused = decode_push_encoded(payload_of(encode_push_encoded(too_many)));
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kResourceExhausted);
  }
  for (const std::uint32_t window : {0U, kMaxWindowChunks + 1}) {
    auto bad = header;
    bad.window_chunks = window;
    CHECK(decode_push_encoded(payload_of(encode_push_encoded(bad))).error().code == ErrorCode::kProtocol);
  }
  header.chunk_bytes = kMaxChunkBytes + 1;
  CHECK_FALSE(decode_push_encoded(payload_of(encode_push_encoded(header))));
  header.chunk_bytes = 1U << 20;
  header.frame_bytes = 0;
  CHECK_FALSE(decode_push_encoded(payload_of(encode_push_encoded(header))));
}

TEST_CASE("wire v4 pushes carry a purpose, a delta and a fidelity product, replies a product", "[proxy][peer][unit]") {
  EncodedEntryHeader header;
  header.id = 5;
  header.key = {1, 2};
  header.frame_bytes = 1000;
  header.chunk_bytes = 512;
  header.window_chunks = 4;
  header.chain.block_tokens = 2;
  header.chain.tokens = {7, 8};
  header.route = "a-to-b";
  header.purpose = PushPurpose::kPrefetch;
  header.skip_tokens = 2;
  header.fidelity_product = 0.9;
  const auto payload = payload_of(encode_push_encoded(header));
  const auto pushed = decode_push_encoded(payload);
  REQUIRE(pushed);
  CHECK(pushed.value().purpose == PushPurpose::kPrefetch);
  CHECK(pushed.value().skip_tokens == 2);
  CHECK(pushed.value().fidelity_product == 0.9);
  CHECK(pushed.value().route == "a-to-b");
  for (std::size_t length = 0; length < payload.size(); ++length) {
    CHECK_FALSE(decode_push_encoded(std::span(payload.data(), length)));
  }
  auto longer = payload;
  longer.push_back(std::byte{0});
  CHECK(decode_push_encoded(longer).error().code == ErrorCode::kProtocol);
  // The purpose byte sits before skip_tokens and the product: 3 names nothing.
  auto bad_purpose = payload;
  bad_purpose[bad_purpose.size() - 17] = std::byte{3};
  const auto unknown = decode_push_encoded(bad_purpose);
  REQUIRE_FALSE(unknown);
  CHECK_THAT(unknown.error().message, Catch::Contains("push purpose 3 unknown"));
  CHECK(push_purpose_name(PushPurpose::kSpill) == "spill");
  // A product is in (0, 1]: 0, NaN, -0 and above 1 are refused, in pushes and in fetch replies.
  for (const double bad : {0.0, -0.0, std::numeric_limits<double>::quiet_NaN(), 1.5}) {
    auto lying = header;
    lying.fidelity_product = bad;
    const auto refused = decode_push_encoded(payload_of(encode_push_encoded(lying)));
    REQUIRE_FALSE(refused);
    CHECK_THAT(refused.error().message, Catch::Contains("fidelity_product"));
    const auto reply = decode_fetch_reply(payload_of(encode_fetch_reply(5, &lying)), 5);
    REQUIRE_FALSE(reply);
    CHECK_THAT(reply.error().message, Catch::Contains("fidelity_product"));
  }
  // A fetch reply carries the product but no purpose or delta (they are a push's).
  const auto reply = decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 5);
  REQUIRE(reply);
  REQUIRE(reply.value());
  CHECK(reply.value()->fidelity_product == 0.9);
  CHECK(reply.value()->purpose == PushPurpose::kPush);
  CHECK(reply.value()->skip_tokens == 0);
  CHECK(reply.value()->route.empty());
  // A push's route is bounded like a fetch's.
  auto long_route = header;
  long_route.route.assign(kMaxRouteBytes + 1, 'r');
  CHECK_THAT(decode_push_encoded(payload_of(encode_push_encoded(long_route))).error().message,
             Catch::Contains("route of 257 bytes"));
}

TEST_CASE("summaries carry the node state and at most one frame of keys, and must match their count",
          "[proxy][peer][unit]") {
  std::vector<kvrelay::kv_store::EntryKey> keys;
  for (std::uint64_t index = 0; index < kMaxSummaryKeys + 10; ++index)
    keys.push_back({1, index});
  const NodeState node{1ULL << 30, 1ULL << 20, 256ULL << 20, 64ULL << 20, 3, 5, 1'000'000'000, 12'345};
  const auto frame = encode_summary(keys, node);
  CHECK(frame.size() - kPeerHeaderBytes <= kMaxControlPayload);
  const auto decoded = decode_summary(payload_of(frame));
  REQUIRE(decoded);
  CHECK(decoded.value().keys.size() == kMaxSummaryKeys);
  CHECK(decoded.value().node == node);
  CHECK(decoded.value().node.queued_transfers == 3);
  CHECK(decoded.value().node.spill_accept_left == 5);
  CHECK(decoded.value().node.link_bytes_per_s == 1'000'000'000);
  CHECK(decoded.value().node.sent_bytes_per_s == 12'345);
  auto lying = payload_of(encode_summary(std::span(keys.data(), 2), node));
  const std::uint32_t count = 3;
  std::memcpy(lying.data() + kNodeStateBytes, &count, sizeof(count));
  CHECK(decode_summary(lying).error().code == ErrorCode::kProtocol);
  const auto empty = payload_of(encode_summary({}, node));
  REQUIRE(empty.size() == kNodeStateBytes + 4);
  for (std::size_t length = 0; length < empty.size(); ++length) {
    const auto cut = decode_summary(std::span(empty.data(), length));
    REQUIRE_FALSE(cut);
    CHECK(cut.error().code == ErrorCode::kTruncated);
  }
  CHECK(decode_summary(empty).value().keys.empty());
  // Each key carries its entry's product; without products every key is exact (1).
  const std::vector<double> products{1.0, 0.81};
  const auto with_products = decode_summary(payload_of(encode_summary(std::span(keys.data(), 2), node, products)));
  REQUIRE(with_products);
  CHECK(with_products.value().products == products);
  CHECK(decode_summary(payload_of(encode_summary(std::span(keys.data(), 2), node))).value().products ==
        std::vector<double>{1.0, 1.0});
  for (const double bad : {0.0, -0.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    const std::vector<double> wrong{1.0, bad};
    const auto refused = decode_summary(payload_of(encode_summary(std::span(keys.data(), 2), node, wrong)));
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kProtocol);
  }
}

TEST_CASE("a bandwidth probe asks for 1..1 MiB and nothing else", "[proxy][peer][unit]") {
  const auto frame = encode_probe(kMaxProbeBytes);
  const auto header = decode_peer_header(std::span<const std::byte, kPeerHeaderBytes>(frame.data(), kPeerHeaderBytes));
  REQUIRE(header);
  CHECK(header.value().type == PeerMessage::kProbe);
  CHECK(decode_probe(payload_of(frame)).value() == kMaxProbeBytes);
  CHECK(decode_probe(payload_of(encode_probe(1))).value() == 1U);
  for (const std::uint32_t bytes : {0U, kMaxProbeBytes + 1}) {
    const auto refused = decode_probe(payload_of(encode_probe(bytes)));
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kProtocol);
  }
  auto longer = payload_of(frame);
  longer.push_back(std::byte{0});
  CHECK(decode_probe(longer).error().code == ErrorCode::kProtocol);
  CHECK_FALSE(decode_probe(std::span(longer.data(), 3)));
  CHECK(known_peer_message(static_cast<std::uint16_t>(PeerMessage::kProbeReply)));
}

TEST_CASE("a field that runs past the end fails every field after it (found by fuzz_peer_frames)",
          "[proxy][peer][unit]") {
  // A Fetch whose codec string claims more bytes than follow, where the 4 bytes after its
  // length would still have read as a hash count: the decoder used to move from the missing
  // string and corrupt the heap.
  ByteWriter writer;
  writer.put(std::uint64_t{5}).put(std::uint64_t{1}).put(std::uint16_t{200});
  writer.put(std::uint32_t{0});
  const auto fetch = decode_fetch(writer.bytes());
  REQUIRE_FALSE(fetch.has_value());
  CHECK(fetch.error().code == ErrorCode::kTruncated);

  // The reader itself: after a failed read even a read that would fit fails.
  const std::array<std::byte, 6> six{};
  ByteReader reader(six);
  CHECK_FALSE(reader.get<std::uint64_t>().has_value());
  CHECK_FALSE(reader.get<std::uint32_t>().has_value());
  CHECK(reader.failed());

  // A fetch reply shorter than its id, and a push header whose sizes are cut short.
  const std::array<std::byte, 5> short_reply{std::byte{1}, std::byte{0}, std::byte{0}, std::byte{0}, std::byte{1}};
  CHECK(decode_fetch_reply(short_reply, 1).error().code == ErrorCode::kTruncated);
  ByteWriter push;
  push.put(std::uint64_t{9}).put(std::uint64_t{1}).put(std::uint64_t{2}).put(std::uint32_t{64});
  CHECK(decode_push_encoded(push.bytes()).error().code == ErrorCode::kProtocol);
}

TEST_CASE("a transfer that fits one chunk goes as two page-aligned halves, others keep the chunk size",
          "[proxy][peer][unit]") {
  constexpr std::uint32_t kChunk = 1U << 20;
  CHECK(transfer_chunk_bytes(kChunk, 1U << 20) == 512U << 10);
  CHECK(transfer_chunk_bytes(kChunk, (700U << 10) + 3) == 352U << 10);  // 350 KiB + 2, up to a page
  CHECK(transfer_chunk_bytes(kChunk, kSplitTransferMinBytes) == kSplitTransferMinBytes / 2);
  CHECK(transfer_chunk_bytes(kChunk, kSplitTransferMinBytes - 1) == kChunk);  // too small to pay
  CHECK(transfer_chunk_bytes(kChunk, (1U << 20) + 1) == kChunk);              // two chunks already
  CHECK(transfer_chunk_bytes(kChunk, 0) == kChunk);
  CHECK(transfer_chunk_bytes(64U << 10, 1U << 20) == 64U << 10);
  // Two halves always cover the transfer, never three.
  for (std::uint64_t bytes = kSplitTransferMinBytes; bytes <= kChunk; bytes += 4093) {
    const std::uint32_t chunk = transfer_chunk_bytes(kChunk, bytes);
    CHECK(chunk % 4096 == 0);
    CHECK((bytes + chunk - 1) / chunk == 2);
  }
}

TEST_CASE("peer stats round-trip with every counter, and a short or long reply is refused", "[proxy][peer][unit]") {
  PeerServerStats stats;
  stats.sessions = 1;
  stats.committed_transfers = 3;
  stats.bytes_received = 1U << 20;
  stats.chunks_received = 2;
  stats.fetches_served = 5;
  const auto payload = payload_of(encode_peer_stats(stats));
  REQUIRE(payload.size() == 8 * sizeof(std::uint64_t));
  const auto decoded = decode_peer_stats(payload);
  REQUIRE(decoded);
  CHECK(decoded.value().chunks_received == 2);
  CHECK(decoded.value().fetches_served == 5);
  CHECK(decoded.value().bytes_received == 1U << 20);
  CHECK(decode_peer_stats(std::span(payload).first(7 * sizeof(std::uint64_t))).error().code == ErrorCode::kTruncated);
  auto longer = payload;
  longer.push_back(std::byte{0});
  CHECK(decode_peer_stats(longer).error().code == ErrorCode::kProtocol);
}

TEST_CASE("acknowledgements and commits round-trip and refuse torn payloads", "[proxy][peer][unit]") {
  const auto ack = payload_of(encode_chunk_ack(77, 12));
  REQUIRE(ack.size() == 12);
  CHECK(decode_chunk_ack(ack).value().id == 77);
  CHECK(decode_chunk_ack(ack).value().index == 12);
  CHECK_FALSE(decode_chunk_ack(std::span(ack).first(11)));
  const auto committed = payload_of(encode_committed(77));
  CHECK(decode_committed(committed).value() == 77);
  CHECK_FALSE(decode_committed(std::span(committed).first(7)));
}

namespace {

std::array<std::byte, kPeerHeaderBytes> header_of(std::uint16_t version, std::uint16_t type, std::uint32_t length) {
  std::array<std::byte, kPeerHeaderBytes> bytes{};
  std::memcpy(bytes.data(), &kPeerMagic, 4);
  std::memcpy(bytes.data() + 4, &version, 2);
  std::memcpy(bytes.data() + 6, &type, 2);
  std::memcpy(bytes.data() + 8, &length, 4);
  return bytes;
}

}  // namespace

TEST_CASE("wire versions: only hello, hello reply and error are read across versions, retired types are unknown",
          "[proxy][peer][unit]") {
  for (const std::uint16_t type : {std::uint16_t{1}, std::uint16_t{2}, std::uint16_t{8}}) {
    INFO("type " << type);
    CHECK(decode_peer_header(header_of(1, type, 10)).error().code == ErrorCode::kBadVersion);
    const auto at_hello = decode_hello_header(header_of(1, type, 10));
    REQUIRE(at_hello);
    CHECK(at_hello.value().version == 1);
  }
  // Anything else of another version is refused even at the hello.
  CHECK(decode_hello_header(header_of(1, 13, 10)).error().code == ErrorCode::kBadVersion);
  CHECK(decode_hello_header(header_of(kPeerVersion + 1, 5, 10)).error().code == ErrorCode::kBadVersion);
  // Version 1's Begin messages are gone for good.
  for (const std::uint16_t retired : {std::uint16_t{3}, std::uint16_t{4}, std::uint16_t{18}}) {
    CHECK_FALSE(known_peer_message(retired));
    CHECK(decode_peer_header(header_of(kPeerVersion, retired, 10)).error().code == ErrorCode::kProtocol);
  }
  // A refusal for a version-1 peer is a version-1 error frame.
  const auto refusal = encode_peer_error_for_version(wire_version_mismatch(1, "a test peer"), 1);
  const auto header =
      decode_hello_header(std::span<const std::byte, kPeerHeaderBytes>(refusal.data(), kPeerHeaderBytes));
  REQUIRE(header);
  CHECK(header.value().version == 1);
  CHECK(header.value().type == PeerMessage::kError);
  const auto error = decode_peer_error(payload_of(refusal));
  CHECK(error.code == ErrorCode::kBadVersion);
  CHECK_THAT(error.message, Catch::Contains("wire version 1") && Catch::Contains("speaks 6"));
  // A hello that claims another version in its payload is refused by name too: versions 3 and 4
  // had the same hello layout as 5 and 6.
  CHECK(kPeerVersion == 6);
  for (const std::uint32_t version : {1U, 3U, 4U, 5U}) {
    Hello old;
    old.protocol_version = version;
    const auto refused = decode_hello(payload_of(encode_hello(PeerMessage::kHello, old)));
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kBadVersion);
    CHECK_THAT(refused.error().message, Catch::Contains(fmt::format("wire version {}", version)));
  }
  // A version 3 peer's first frame is read at the hello (to be refused in its own version) and
  // nowhere else.
  CHECK(decode_hello_header(header_of(3, 1, 10)).value().version == 3);
  CHECK(decode_peer_header(header_of(3, 13, 10)).error().code == ErrorCode::kBadVersion);
}
