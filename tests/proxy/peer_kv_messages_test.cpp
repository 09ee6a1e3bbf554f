// Peer-plane KV path messages (Fetch, FetchReply, PushEncoded, Summary): round trips, and every
// truncated or lying payload refused.
#include <catch2/catch.hpp>

#include <cstring>

#include "kvrelay/proxy/peer/peer_protocol.h"

using namespace kvrelay;
using namespace kvrelay::proxy::peer;

namespace {

std::vector<std::byte> payload_of(const std::vector<std::byte>& frame) {
  return {frame.begin() + static_cast<std::ptrdiff_t>(kPeerHeaderBytes), frame.end()};
}

}  // namespace

TEST_CASE("fetch requests round-trip; truncated or lying ones are refused", "[proxy][peer][unit]") {
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
  const auto full = payload_of(encode_fetch({43, 7, "raw", {9, 8}}));
  CHECK(payload.size() == full.size() + 8);  // a full fetch is what peers without deltas send
  const auto decoded = decode_fetch(payload);
  REQUIRE(decoded);
  CHECK(decoded.value().skip_tokens == 96);
  CHECK(decoded.value().hashes == std::vector<std::uint64_t>{9, 8});
  for (std::size_t length = full.size() + 1; length < payload.size(); ++length) {
    CHECK_FALSE(decode_fetch(std::span(payload.data(), length)));  // a torn skip field
  }
}

TEST_CASE("fetch replies and pushes check their ids, sizes and chunking", "[proxy][peer][unit]") {
  EncodedEntryHeader header;
  header.id = 5;
  header.key = {1, 2};
  header.frame_bytes = 3 * 1024 * 1024 + 1;
  header.frame_checksum = 0xABCD;
  header.chunk_bytes = 1U << 20;
  CHECK(header.chunk_count() == 4);

  const auto found = decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 5);
  REQUIRE(found);
  REQUIRE(found.value());
  CHECK(found.value()->frame_bytes == header.frame_bytes);
  CHECK_FALSE(decode_fetch_reply(payload_of(encode_fetch_reply(5, &header)), 6));  // another request's reply
  const auto miss = decode_fetch_reply(payload_of(encode_fetch_reply(5, nullptr)), 5);
  REQUIRE(miss);
  CHECK_FALSE(miss.value());

  const auto pushed = decode_push_encoded(payload_of(encode_push_encoded(header)));
  REQUIRE(pushed);
  CHECK(pushed.value().key == header.key);
  header.chunk_bytes = kMaxChunkBytes + 1;
  CHECK_FALSE(decode_push_encoded(payload_of(encode_push_encoded(header))));
  header.chunk_bytes = 1U << 20;
  header.frame_bytes = 0;
  CHECK_FALSE(decode_push_encoded(payload_of(encode_push_encoded(header))));
}

TEST_CASE("summaries carry at most one frame of keys and must match their count", "[proxy][peer][unit]") {
  std::vector<kvrelay::shm::EntryKey> keys;
  for (std::uint64_t index = 0; index < kMaxSummaryKeys + 10; ++index)
    keys.push_back({1, index});
  const auto frame = encode_summary(keys);
  CHECK(frame.size() - kPeerHeaderBytes <= kMaxControlPayload);
  const auto decoded = decode_summary(payload_of(frame));
  REQUIRE(decoded);
  CHECK(decoded.value().size() == kMaxSummaryKeys);
  auto lying = payload_of(encode_summary(std::span(keys.data(), 2)));
  const std::uint32_t count = 3;
  std::memcpy(lying.data(), &count, sizeof(count));
  CHECK_FALSE(decode_summary(lying));
}
