// The summary medium's prompt work (issue #28, docs/summary.md): spans from token ids and text
// hints, the summariser's request and reply, and B's prompt with the summary in its place.

#include "kvrelay/proxy/summary_prompt.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace kvrelay;
using namespace kvrelay::proxy;
using nlohmann::json;

TEST_CASE("summary prompt: token ids, a batch of one, text, hints and what cannot be summarised", "[proxy][summary]") {
  const auto ids = summarisable_prompt(
      R"({"prompt": [1, 5, 9, 300], "max_tokens": 7, "cache_salt": "s",
          "kv_transfer_params": {"kvrelay": {"handoff_tokens": 3}}})");
  REQUIRE(ids);
  CHECK(ids.value().kind == PromptKind::kTokenIds);
  CHECK(ids.value().tokens == std::vector<TokenId>{1, 5, 9, 300});
  CHECK(ids.value().handoff_tokens == 3U);
  CHECK_FALSE(ids.value().handoff_chars);
  CHECK(ids.value().max_tokens == 7U);
  CHECK(ids.value().cache_salt == "s");

  const auto batch = summarisable_prompt(R"({"prompt": [[4, 5]], "kv_transfer_params": {"cache_salt": "k"}})");
  REQUIRE(batch);
  CHECK(batch.value().tokens == std::vector<TokenId>{4, 5});
  CHECK(batch.value().cache_salt == "k");

  const auto text =
      summarisable_prompt(R"({"prompt": "héllo world", "kv_transfer_params": {"kvrelay": {"handoff_chars": 5}}})");
  REQUIRE(text);
  CHECK(text.value().kind == PromptKind::kText);
  CHECK(text.value().handoff_chars == 5U);

  CHECK_FALSE(summarisable_prompt(R"({"messages": [{"role": "user", "content": "hi"}]})"));
  CHECK_FALSE(summarisable_prompt(R"({"prompt": [[1], [2]]})"));
  CHECK_FALSE(summarisable_prompt(R"({"prompt": [1, -2]})"));
  CHECK_FALSE(summarisable_prompt(R"({"prompt": []})"));
  CHECK_FALSE(summarisable_prompt("[1, 2]"));
  const auto bad_hint =
      summarisable_prompt(R"({"prompt": [1], "kv_transfer_params": {"kvrelay": {"handoff_tokens": 0}}})");
  REQUIRE_FALSE(bad_hint);
  CHECK_THAT(bad_hint.error().message, Catch::Contains("handoff_tokens"));
}

TEST_CASE("summary prompt: a text span counts characters, not bytes, and stops at the prompt's end",
          "[proxy][summary]") {
  const std::string text = "h\xc3\xa9llo world";  // é is two bytes
  const auto span = text_span(text, 5);
  REQUIRE(span);
  CHECK(span.value().text_bytes == 6);
  CHECK(span.value().chars == 5U);
  CHECK(span.value().tokens == 2);  // ~4 bytes a token
  CHECK_FALSE(text_span(text, 40));
  CHECK_FALSE(text_span("ab\xff", 3));
}

TEST_CASE("summary prompt: the summariser's request is the span, greedy, within the budget", "[proxy][summary]") {
  RouteSummaryPolicy settings;
  settings.max_tokens = 12;
  SummarisablePrompt ids;
  ids.tokens = {1, 2, 3, 4, 5};
  const auto request = json::parse(summariser_request_body(ids, SummarySpan{3, std::nullopt, 0}, settings));
  CHECK(request["prompt"] == json::array({1, 2, 3}));
  CHECK(request["max_tokens"] == 12);
  CHECK(request["temperature"] == 0);
  CHECK(request["stream"] == false);
  CHECK_FALSE(request.contains("model"));

  SummarisablePrompt text;
  text.kind = PromptKind::kText;
  text.text = "The planner said: ship it. Now review.";
  settings.model = "small";
  settings.instruction = "\nTL;DR:";
  const auto asked = json::parse(summariser_request_body(text, SummarySpan{7, 26, 26}, settings));
  CHECK(asked["prompt"] == "The planner said: ship it.\nTL;DR:");
  CHECK(asked["model"] == "small");
}

TEST_CASE("summary prompt: the summariser's reply, and why one cannot stand in", "[proxy][summary]") {
  const auto ids = parse_summariser_reply(
      200, R"({"choices": [{"text": "xy", "token_ids": [7, 8, 9]}], "usage": {"completion_tokens": 3}})",
      PromptKind::kTokenIds);
  REQUIRE(ids);
  CHECK(ids.value().tokens == std::vector<TokenId>{7, 8, 9});
  CHECK(ids.value().completion_tokens == 3);
  const auto text = parse_summariser_reply(200, R"({"choices": [{"text": "shipped"}]})", PromptKind::kText);
  REQUIRE(text);
  CHECK(text.value().text == "shipped");
  CHECK(text.value().completion_tokens == 2);

  // Text alone for a token-id prompt: B's ids cannot be made without the tokenizer.
  const auto no_ids = parse_summariser_reply(200, R"({"choices": [{"text": "shipped"}]})", PromptKind::kTokenIds);
  REQUIRE_FALSE(no_ids);
  CHECK_THAT(no_ids.error().message, Catch::Contains("no token ids"));
  CHECK_FALSE(parse_summariser_reply(200, R"({"choices": [{"token_ids": []}]})", PromptKind::kTokenIds));
  CHECK_FALSE(parse_summariser_reply(200, R"({"choices": [{"text": ""}]})", PromptKind::kText));
  CHECK_FALSE(parse_summariser_reply(200, R"({"choices": []})", PromptKind::kText));
  CHECK_FALSE(parse_summariser_reply(200, "not json", PromptKind::kText));
  const auto refused = parse_summariser_reply(503, R"({"error": "busy"})", PromptKind::kText);
  REQUIRE_FALSE(refused);
  CHECK_THAT(refused.error().message, Catch::Contains("503"));
}

TEST_CASE("summary prompt: B's body carries the summary in place of the span, every other field kept",
          "[proxy][summary]") {
  const std::string body = R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4, "stream": true})";
  auto prompt = summarisable_prompt(body).value();
  Summary summary;
  summary.tokens = {90, 91};
  const auto rewritten = body_with_summary(body, prompt, SummarySpan{4, std::nullopt, 0}, summary, "{summary}");
  REQUIRE(rewritten);
  const auto document = json::parse(rewritten.value());
  CHECK(document["prompt"] == json::array({90, 91, 5, 6}));
  CHECK(document["max_tokens"] == 4);
  CHECK(document["stream"] == true);
  CHECK(summary_bytes(summary, PromptKind::kTokenIds) == 8);
  CHECK_FALSE(body_with_summary(body, prompt, SummarySpan{7, std::nullopt, 0}, summary, "{summary}"));

  const std::string text_body = R"({"prompt": "Long history here. Question?"})";
  auto text = summarisable_prompt(text_body).value();
  Summary said;
  said.text = "history";
  const auto filled = body_with_summary(text_body, text, SummarySpan{5, 18, 18}, said, "[{summary}] ({summary})");
  REQUIRE(filled);
  CHECK(json::parse(filled.value())["prompt"] == "[history] (history) Question?");
  CHECK(summary_bytes(said, PromptKind::kText) == 7);
}
