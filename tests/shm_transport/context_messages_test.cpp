// Data-plane version 2 messages (Resolve, PrefillReport): round trips, and every malformed
// payload refused with an error that names the problem.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "kvrelay/shm_transport/control_protocol.h"

using namespace kvrelay;
using namespace kvrelay::shm;

TEST_CASE("resolve requests round-trip and reject malformed payloads", "[shm][protocol]") {
  ResolveRequest request;
  request.model_id = 0x1234;
  request.block_tokens = 16;
  request.prompt_tokens = 50;
  request.block_hashes = {1, 2, 3};
  request.params_json = R"({"agent":"reader","routes":["a-to-b"]})";
  const auto bytes = encode_resolve(request);
  const auto decoded = decode_resolve(bytes);
  REQUIRE(decoded);
  CHECK(decoded.value().model_id == 0x1234);
  CHECK(decoded.value().block_hashes == std::vector<std::uint64_t>{1, 2, 3});
  CHECK(decoded.value().params_json == request.params_json);

  // Every truncation is refused.
  for (std::size_t length = 0; length < bytes.size(); ++length) {
    CHECK_FALSE(decode_resolve(std::span(bytes.data(), length)));
  }
  // More blocks than the prompt holds.
  request.prompt_tokens = 47;
  const auto too_many = decode_resolve(encode_resolve(request));
  REQUIRE_FALSE(too_many);
  CHECK(too_many.error().message.find("exceed the prompt") != std::string::npos);
  // A hash count far beyond the payload.
  auto lying = encode_resolve(ResolveRequest{1, 16, 1000, {}, "", kDataPlaneVersion});
  const std::uint32_t huge = 1U << 30;
  std::memcpy(lying.data() + 20, &huge, sizeof(huge));
  const auto refused = decode_resolve(lying);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kTruncated);
  // block_tokens 0 would divide by zero downstream.
  CHECK_FALSE(decode_resolve(encode_resolve(ResolveRequest{1, 0, 10, {}, "", kDataPlaneVersion})));
}

TEST_CASE("prefill reports round-trip and reject impossible figures", "[shm][protocol]") {
  const PrefillReport report{7, 17, 225, 0.0042, R"({"agent":"reader"})"};
  const auto decoded = decode_prefill_report(encode_prefill_report(report));
  REQUIRE(decoded);
  CHECK(decoded.value().computed_tokens == 17);
  CHECK(decoded.value().context_tokens == 225);
  CHECK(decoded.value().seconds == Approx(0.0042));
  CHECK(decoded.value().params_json == report.params_json);

  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 300, 225, 0.1, ""})));  // computed > context
  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 1, 2, -1.0, ""})));
  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 1, 2, std::numeric_limits<double>::quiet_NaN(), ""})));
  auto trailing = encode_prefill_report(report);
  trailing.push_back(std::byte{0});
  CHECK_FALSE(decode_prefill_report(trailing));
}

TEST_CASE("commits round-trip with and without fidelity and chain and reject malformed payloads", "[shm][protocol]") {
  CommitRequest commit{7, {1, 2}, KvLayout{2, 2, 4, DType::kFloat32, 3}, 384, 0xabc, R"({"agent":"a"})", {}, {}};
  for (const std::uint32_t version : {kFidelityDataPlaneVersion, kChainDataPlaneVersion, kSpanDataPlaneVersion}) {
    for (const bool with_context : {false, true}) {
      for (const auto& fidelity : {Fidelity::exact(), Fidelity::lossy("int4", 16)}) {
        for (const bool with_chain : {false, true}) {
          if (!with_context && !fidelity.is_exact()) continue;  // a plain Commit cannot say it
          if (with_chain && (!with_context || version < kChainDataPlaneVersion)) continue;
          commit.fidelity = fidelity;
          commit.chain = with_chain ? std::optional(ChainHeader{16, 0x1234, "", 32}) : std::nullopt;
          const auto bytes = encode_commit(commit, with_context, version);
          const auto decoded = decode_commit(bytes, with_context, version);
          REQUIRE(decoded.has_value());
          CHECK(decoded.value().region_id == 7);
          CHECK(decoded.value().key == commit.key);
          CHECK(decoded.value().checksum == 0xabc);
          CHECK(decoded.value().fidelity == fidelity);
          CHECK(decoded.value().params_json == (with_context ? commit.params_json : std::string()));
          CHECK(decoded.value().chain.has_value() == with_chain);
          if (with_chain) {
            CHECK(decoded.value().chain->block_tokens == 16);
            CHECK(decoded.value().chain->root == 0x1234);
            CHECK(decoded.value().chain->count == 32);
          }
          for (std::size_t length = 0; length < bytes.size(); ++length) {
            // A version-4 CommitContext cut exactly before its optional fidelity is a valid exact commit.
            if (version < kChainDataPlaneVersion && with_context && !fidelity.is_exact() &&
                length == encode_commit(commit, false, version).size() + 4 + commit.params_json.size()) {
              continue;
            }
            CHECK_FALSE(decode_commit(std::span(bytes.data(), length), with_context, version).has_value());
          }
        }
      }
    }
  }
  commit.chain.reset();
  // A version-5 chain header that is not whole blocks, or of block size 0, is refused.
  for (const ChainHeader& bad : {ChainHeader{16, 1, "", 17}, ChainHeader{0, 1, "", 0}}) {
    commit.chain = bad;
    const auto refused =
        decode_commit(encode_commit(commit, true, kChainDataPlaneVersion), true, kChainDataPlaneVersion);
    REQUIRE_FALSE(refused.has_value());
    CHECK_THAT(refused.error().message, Catch::Contains("block"));
  }
  commit.chain.reset();
  // An exact fidelity spelled out is refused: exact KV is sent without one.
  commit.fidelity = Fidelity::exact();
  auto spelled = encode_commit(commit, true, kFidelityDataPlaneVersion);
  ByteWriter trailer;
  encode_fidelity(trailer, Fidelity::exact());
  spelled.insert(spelled.end(), trailer.bytes().begin(), trailer.bytes().end());
  const auto refused = decode_commit(spelled, true, kFidelityDataPlaneVersion);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().message.find("exact fidelity") != std::string::npos);
}

TEST_CASE("version 7: resolve flags and a resolved span round-trip and older versions refuse the flags",
          "[shm][protocol]") {
  ResolveRequest request{1, 16, 40, {11, 12}, "", kDataPlaneVersion};
  request.flags = kResolveSpan | kResolveSparse;
  const auto decoded = decode_resolve(encode_resolve(request, kSpanDataPlaneVersion), kSpanDataPlaneVersion);
  REQUIRE(decoded);
  CHECK(decoded.value().flags == (kResolveSpan | kResolveSparse));
  const auto older =
      decode_resolve(encode_resolve(request, kReservationDataPlaneVersion), kReservationDataPlaneVersion);
  REQUIRE_FALSE(older);
  CHECK(older.error().message.find("unknown flags") != std::string::npos);

  ResolvedMeta meta;
  meta.blocks = 3;
  meta.first_block = 2;
  meta.kept = {{0, 4}, {60, 20}};
  ByteWriter writer;
  encode_resolved_span(writer, meta);
  ResolvedMeta read;
  read.blocks = 3;
  ByteReader reader(writer.bytes());
  REQUIRE(decode_resolved_span(reader, read));
  CHECK(read.first_block == 2);
  CHECK(read.kept == meta.kept);
  CHECK_FALSE(read.is_prefix());

  meta.kept = {{10, 4}, {12, 2}};  // overlapping runs
  ByteWriter hostile;
  encode_resolved_span(hostile, meta);
  ByteReader hostile_reader(hostile.bytes());
  CHECK(decode_resolved_span(hostile_reader, read).error().code == ErrorCode::kProtocol);
  ByteReader truncated(std::span(writer.bytes()).first(5));
  CHECK(decode_resolved_span(truncated, read).error().code == ErrorCode::kProtocol);
}
