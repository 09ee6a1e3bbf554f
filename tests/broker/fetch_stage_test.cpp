// The fetch stage against a fake Fetcher: which sources are asked, what each attempt records,
// and how the first good frame is joined to the held prefix.

#include <catch2/catch.hpp>

#include <map>

#include "kvrelay/codec_plugins/registry.h"

#include "fetch_missing.h"
#include "kv_media.h"
#include "stage_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;
using namespace kvrelay::broker::stage_testing;

namespace {

// Each source answers with an error, with nothing, or with the chain up to `blocks` blocks as a
// frame of `codec` (less what the request skips).
struct FakeAnswer {
  std::optional<Error> error;
  std::size_t blocks = 0;
  std::string codec = "raw";
  bool lying_tokens = false;  // a token id of its chain changed: KV of another prompt
};

class FakeFetcher final : public Fetcher {
 public:
  FakeFetcher(const codec::CodecRegistry& codecs, std::map<std::string, FakeAnswer> answers)
      : codecs_(codecs), answers_(std::move(answers)) {}
  std::vector<std::string> candidates(std::uint64_t, std::span<const std::uint64_t>) override {
    std::vector<std::string> sources;
    for (const auto& [source, answer] : answers_)
      sources.push_back(source);
    return sources;
  }
  Result<std::optional<peer::PeerClient::FetchedFrame>> fetch(const std::string& source,
                                                              const peer::FetchRequest& request, peer::Deadline,
                                                              std::uint64_t) override {
    asked.push_back(source);
    last_request = request;
    const FakeAnswer& answer = answers_.at(source);
    if (answer.error) return *answer.error;
    if (answer.blocks == 0) return std::optional<peer::PeerClient::FetchedFrame>();
    const std::uint64_t tokens = answer.blocks * kBlockTokens - request.skip_tokens;
    auto frame = encode_entry(codecs_, answer.codec, *tiny_entry(tokens));
    if (!frame) return frame.error();
    peer::PeerClient::FetchedFrame fetched;
    fetched.key = {request.model_id, chain_of(answer.blocks).back()};
    fetched.chain = stage_chain(answer.blocks);
    if (answer.lying_tokens) fetched.chain.tokens.back() ^= 1U;
    fetched.buffer = buffers_.take(frame.value().size());
    std::copy(frame.value().begin(), frame.value().end(), fetched.buffer.u8().begin());
    fetched.frame_bytes = frame.value().size();
    return std::optional(std::move(fetched));
  }
  WarmBufferPool& buffers() override { return buffers_; }

  std::vector<std::string> asked;
  peer::FetchRequest last_request;

 private:
  const codec::CodecRegistry& codecs_;
  std::map<std::string, FakeAnswer> answers_;
  WarmBufferPool buffers_{4, 1 << 20};
};

FetchOutcome run_fetch(FakeFetcher& fetcher, const kv_store::HeldPrefix& held, const std::string& codec, bool lossless,
                       const codec::CodecRegistry& codecs, peer::Deadline deadline = peer::Deadline::max(),
                       std::vector<std::string>* refused = nullptr) {
  const auto request = lookup_of(kChainModel, 4, 70);
  return fetch_missing(fetcher, {request, held, codec, lossless, deadline, 1 << 20, codecs, nullptr,
                                 kv_store::ChainScope::kUnscoped, [refused](const std::string& source) {
                                   if (refused != nullptr) refused->push_back(source);
                                 }});
}

}  // namespace

TEST_CASE("fetch stage: failed and empty sources are recorded and the next one is asked", "[broker][fetch]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  FakeFetcher fetcher(codecs, {{"a-broken", {Error{ErrorCode::kIo, "connection refused"}, 0}},
                               {"b-empty", {std::nullopt, 0}},
                               {"c-holds", {std::nullopt, 3}}});
  const auto outcome = run_fetch(fetcher, {}, "raw", true, codecs);
  REQUIRE(outcome.fetched);
  CHECK(fetcher.asked == std::vector<std::string>{"a-broken", "b-empty", "c-holds"});
  CHECK(outcome.fetched->source == "c-holds");
  CHECK(outcome.fetched->blocks == 3);
  CHECK(outcome.fetched->entry->info.layout.tokens == 3 * kBlockTokens);
  CHECK(outcome.fetched->entry->fidelity.is_exact());
  REQUIRE(outcome.attempts.size() == 3);
  CHECK(outcome.attempts[0]["result"].get<std::string>().find("connection refused") != std::string::npos);
  CHECK(outcome.attempts[1]["result"] == "holds none");
  CHECK(outcome.attempts[2]["result"] == "fetched");
  CHECK(outcome.attempts[2]["fetched_tokens"] == 3 * kBlockTokens);
  // The request names the chain longest first.
  CHECK(fetcher.last_request.hashes.front() == chain_of(4).back());
  CHECK(fetcher.last_request.skip_tokens == 0);
}

TEST_CASE("fetch stage: a delta is joined to the held prefix", "[broker][fetch]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  FakeFetcher fetcher(codecs, {{"peer", {std::nullopt, 4}}});
  const kv_store::HeldPrefix held{tiny_entry(kBlockTokens), 1};
  const auto outcome = run_fetch(fetcher, held, "raw", true, codecs);
  REQUIRE(outcome.fetched);
  CHECK(fetcher.last_request.skip_tokens == kBlockTokens);
  CHECK(fetcher.last_request.hashes.size() == 3);  // only the blocks after the held one
  CHECK(outcome.fetched->entry->info.layout.tokens == 4 * kBlockTokens);
  CHECK(outcome.attempts[0]["held_tokens"] == kBlockTokens);
  CHECK(outcome.attempts[0]["steps"]["join_ms"].get<double>() >= 0.0);
}

TEST_CASE("fetch stage: a lossy frame never answers a lossless fetch", "[broker][fetch]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  FakeFetcher fetcher(codecs, {{"lossy", {std::nullopt, 3, "int8"}}});
  const auto outcome = run_fetch(fetcher, {}, "raw", true, codecs);
  CHECK_FALSE(outcome.fetched);
  REQUIRE(outcome.attempts.size() == 1);
  CHECK(outcome.attempts[0]["result"].get<std::string>().find("wrong codec") != std::string::npos);
  // Asked for int8, it is what the medium delivers.
  const auto lossy = run_fetch(fetcher, {}, "int8", false, codecs);
  REQUIRE(lossy.fetched);
  CHECK(lossy.fetched->entry->fidelity.lossy_codec == "int8");
}

TEST_CASE("fetch stage: past the deadline no source is asked", "[broker][fetch]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  FakeFetcher fetcher(codecs, {{"peer", {std::nullopt, 3}}});
  const auto outcome = run_fetch(fetcher, {}, "raw", true, codecs, std::chrono::steady_clock::now());
  CHECK_FALSE(outcome.fetched);
  CHECK(fetcher.asked.empty());
  CHECK(outcome.attempts[0]["result"] == "skipped: lookup deadline reached");
}

TEST_CASE("fetch stage: KV whose token ids do not hash to the asked chain is refused, and the next source asked",
          "[broker][fetch][security]") {
  const auto codecs = codec::CodecRegistry::with_builtins();
  FakeFetcher fetcher(codecs, {{"a-liar", {std::nullopt, 3, "raw", true}}, {"b-honest", {std::nullopt, 3}}});
  std::vector<std::string> refused;
  const auto outcome = run_fetch(fetcher, {}, "raw", true, codecs, peer::Deadline::max(), &refused);
  REQUIRE(outcome.fetched.has_value());
  CHECK(outcome.fetched->source == "b-honest");
  CHECK(refused == std::vector<std::string>{"a-liar"});
  REQUIRE(outcome.attempts.size() == 2);
  CHECK_THAT(outcome.attempts[0]["result"].get<std::string>(), Catch::Contains("chain_mismatch"));
  // What is kept carries the verified token ids, so it may be served to peers in turn.
  REQUIRE(outcome.fetched->entry->chain != nullptr);
  CHECK(*outcome.fetched->entry->chain == stage_chain(3));
}
