// The materialize stage: slices to the servable blocks and the codec round trip of a lossy
// medium on one node.

#include "materialize.h"

#include <catch2/catch.hpp>

#include <algorithm>

#include "kvrelay/codec_plugins/registry.h"

#include "kv_media.h"
#include "stage_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;
using namespace kvrelay::broker::stage_testing;

TEST_CASE("materialize: an entry longer than the servable blocks is sliced", "[broker][materialize]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  const std::string codec = "raw";
  auto served = entry_to_serve({codecs, tiny_entry(3 * kBlockTokens), 3, 2, kBlockTokens, codec, false, 1 << 20});
  REQUIRE(served);
  CHECK(served.value().blocks == 2);
  CHECK(served.value().entry->info.layout.tokens == 2 * kBlockTokens);
  CHECK_FALSE(served.value().round_trip);
  CHECK(served.value().entry->fidelity.is_exact());

  const auto whole = tiny_entry(2 * kBlockTokens);
  auto kept = entry_to_serve({codecs, whole, 2, 4, kBlockTokens, codec, false, 1 << 20});
  REQUIRE(kept);
  CHECK(kept.value().entry == whole);  // nothing to cut: the same entry
}

TEST_CASE("materialize: a longer entry the prefix index found is served as its first blocks",
          "[broker][materialize][prefix_index]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  const std::string codec = "raw";
  // A 4-block entry standing for a 2-block prefix; lossy after its exact first 2 blocks.
  const auto longer = tiny_entry(4 * kBlockTokens, Fidelity::lossy("int8", 2 * kBlockTokens));
  auto served = entry_to_serve({codecs, longer, 2, 3, kBlockTokens, codec, false, 1 << 20});
  REQUIRE(served);
  CHECK(served.value().blocks == 2);
  CHECK(served.value().entry->info.layout.tokens == 2 * kBlockTokens);
  CHECK(served.value().entry->fidelity.is_exact());  // the served head is exact
  const auto view = kv_store::view_entry(*served.value().entry);
  REQUIRE(view);
  const auto expected = tiny_kv(2 * kBlockTokens);
  CHECK(std::equal(expected.begin(), expected.end(), reinterpret_cast<const float*>(view.value().bytes().data())));
  CHECK(view.value().bytes().size() == expected.size() * sizeof(float));
}

TEST_CASE("materialize: a span serves its blocks only, at their original positions", "[broker][materialize][span]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  const std::string codec = "raw";
  ServeInputs inputs{codecs, tiny_entry(4 * kBlockTokens), 4, 3, kBlockTokens, codec, false, 1 << 20};
  inputs.first_block = 1;
  auto served = entry_to_serve(std::move(inputs));
  REQUIRE(served);
  CHECK(served.value().blocks == 2);  // blocks 1 and 2 of the three servable
  CHECK(served.value().entry->info.layout.tokens == 2 * kBlockTokens);
  CHECK(served.value().entry->chain == nullptr);  // not a prefix of any chain
  const auto view = kv_store::view_entry(*served.value().entry);
  REQUIRE(view);
  // Each tensor's rows are the source's rows kBlockTokens..3*kBlockTokens-1.
  const auto source = tiny_kv(4 * kBlockTokens);
  const auto* got = reinterpret_cast<const float*>(view.value().bytes().data());
  const std::size_t row = source.size() / (4 * kBlockTokens) / (2 * tiny_layout(1).layers);
  const std::size_t tensors = 2 * tiny_layout(1).layers;
  for (std::size_t tensor = 0; tensor < tensors; ++tensor) {
    const float* from = source.data() + (tensor * 4 * kBlockTokens + kBlockTokens) * row;
    CHECK(std::equal(from, from + 2 * kBlockTokens * row, got + tensor * 2 * kBlockTokens * row));
  }
  ServeInputs past{codecs, tiny_entry(2 * kBlockTokens), 2, 2, kBlockTokens, codec, false, 1 << 20};
  past.first_block = 2;
  CHECK(entry_to_serve(std::move(past)).error().code == ErrorCode::kOutOfRange);
}

TEST_CASE("materialize: a lossy medium's round trip delivers what the codec delivers", "[broker][materialize]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  const std::string codec = "int8";
  auto served = entry_to_serve({codecs, tiny_entry(2 * kBlockTokens), 2, 2, kBlockTokens, codec, true, 1 << 20});
  REQUIRE(served);
  REQUIRE(served.value().round_trip);
  CHECK(served.value().round_trip->frame_bytes > 0);
  CHECK(served.value().entry->fidelity.lossy_codec == "int8");
  CHECK(served.value().entry->info.layout.tokens == 2 * kBlockTokens);
}

TEST_CASE("materialize: a frame that does not cover its blocks is refused", "[broker][materialize]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  const auto frame = encode_entry(codecs, "raw", *tiny_entry(kBlockTokens));
  REQUIRE(frame);
  WarmBufferPool buffers(2, 1 << 20);
  const std::string asked = "raw";
  const auto held = tiny_entry(kBlockTokens);
  const auto chain = std::make_shared<const kv_store::EntryChain>(stage_chain(2));
  auto short_frame = entry_from_frame(
      {codecs, frame.value(), held.get(), 3 * kBlockTokens, asked, true, 1 << 20, buffers, nullptr, chain});
  REQUIRE_FALSE(short_frame);
  CHECK(short_frame.error().message == "entry does not cover its blocks");
  auto joined = entry_from_frame(
      {codecs, frame.value(), held.get(), 2 * kBlockTokens, asked, true, 1 << 20, buffers, nullptr, chain});
  REQUIRE(joined);
  CHECK(joined.value().entry->chain == chain);  // the verified token ids of the whole prefix
  CHECK(joined.value().entry->info.layout.tokens == 2 * kBlockTokens);
  CHECK(joined.value().raw_bytes == tiny_layout(kBlockTokens).total_bytes().value());
}
