// Issue #28: the blocks an audit span serves, cut at the prompt boundary A's worker published.

#include "treatment_span.h"

#include <catch2/catch.hpp>

using namespace kvrelay;
using namespace kvrelay::broker;

namespace {

SpanInputs inputs(KvSpan span, std::optional<std::uint64_t> boundary, bool spans = true) {
  return SpanInputs{span, 6, 16, boundary, spans};  // six servable blocks of 16 tokens
}

}  // namespace

TEST_CASE("span all and none serve every available block", "[broker][span]") {
  for (const KvSpan span : {KvSpan::kAll, KvSpan::kNone}) {
    const auto cut = cut_span(inputs(span, std::nullopt, false));
    REQUIRE(cut);
    CHECK(cut.value().first_block == 0);
    CHECK(cut.value().end_block == 6);
  }
}

TEST_CASE("span prompt ends at the last whole block of A's prompt", "[broker][span]") {
  auto cut = cut_span(inputs(KvSpan::kPrompt, 40));  // 40 tokens: blocks 0 and 1 are whole prompt
  REQUIRE(cut);
  CHECK(cut.value().first_block == 0);
  CHECK(cut.value().end_block == 2);
  cut = cut_span(inputs(KvSpan::kPrompt, 1000));  // a prompt longer than what is servable
  REQUIRE(cut);
  CHECK(cut.value().end_block == 6);
  const auto short_prompt = cut_span(inputs(KvSpan::kPrompt, 10));
  REQUIRE_FALSE(short_prompt);
  CHECK(short_prompt.error().code == ErrorCode::kNotFound);
  CHECK(short_prompt.error().message.find("no whole block") != std::string::npos);
}

TEST_CASE("span generated starts at the first block after A's prompt", "[broker][span]") {
  auto cut = cut_span(inputs(KvSpan::kGenerated, 40));  // block 2 holds tokens 32..47: part prompt
  REQUIRE(cut);
  CHECK(cut.value().first_block == 3);
  CHECK(cut.value().end_block == 6);
  cut = cut_span(inputs(KvSpan::kGenerated, 48));
  REQUIRE(cut);
  CHECK(cut.value().first_block == 3);
  const auto no_answer = cut_span(inputs(KvSpan::kGenerated, 90));
  REQUIRE_FALSE(no_answer);
  CHECK(no_answer.error().message.find("no whole block of A's answer") != std::string::npos);
}

TEST_CASE("spans are not delivered without a boundary or to a prefix-only worker", "[broker][span]") {
  for (const KvSpan span : {KvSpan::kPrompt, KvSpan::kGenerated}) {
    const auto unknown = cut_span(inputs(span, std::nullopt));
    REQUIRE_FALSE(unknown);
    CHECK(unknown.error().message.find("does not say where A's prompt ends") != std::string::npos);
  }
  const auto prefix_only = cut_span(inputs(KvSpan::kGenerated, 40, false));
  REQUIRE_FALSE(prefix_only);
  CHECK(prefix_only.error().message.find("leading prefixes only") != std::string::npos);
  CHECK(cut_span(inputs(KvSpan::kPrompt, 40, false)));  // a prompt span is a leading prefix
}
