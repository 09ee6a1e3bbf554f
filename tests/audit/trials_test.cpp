#include "kvrelay/audit/trials.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/core/policy.h"

using namespace kvrelay::audit;
using Catch::Matchers::Contains;

namespace {

std::string error_of(std::string_view text) {
  const auto parsed = parse_trials(text, "t.jsonl");
  REQUIRE_FALSE(parsed);
  return parsed.error().message;
}

}  // namespace

TEST_CASE("Trials round-trip through JSON lines", "[audit][trials]") {
  Trial trial;
  trial.route = "plan-to-code";
  trial.treatment = "T3";
  trial.context_tokens = 1500;
  trial.ttft_ms = 12.5;
  trial.pair_id = "ctx7-r1";
  trial.medium = "kv_raw";
  trial.span = "all";
  trial.receiver_model = "stories260K";
  trial.receiver_agent = "coder";
  trial.e2e_ms = 40.0;
  trial.bytes = 123456;
  trial.top1_agreement = 1.0;
  const auto text =
      trial_line(trial) + "\n\n" + R"({"route":"r","treatment":"T0","context_tokens":10,"ttft_ms":1,"pair_id":3})";
  const auto parsed = parse_trials(text);
  REQUIRE(parsed);
  REQUIRE(parsed.value().trials.size() == 2);
  const auto& back = parsed.value().trials[0];
  CHECK(back.route == trial.route);
  CHECK(back.treatment == "T3");
  CHECK(back.context_tokens == 1500);
  CHECK(back.ttft_ms == 12.5);
  CHECK(back.pair_id == trial.pair_id);
  CHECK(back.medium == "kv_raw");
  CHECK(back.span == "all");
  CHECK(back.receiver_agent == "coder");
  CHECK(back.e2e_ms == 40.0);
  CHECK(back.bytes == 123456U);
  CHECK(parsed.value().trials[1].pair_id == "3");  // integer pair ids are accepted
  CHECK_FALSE(parse_trials(R"({"route":"r","treatment":"T0","context_tokens":10,"ttft_ms":1,"pair_id":null})")
                  .value()
                  .trials[0]
                  .pair_id);
}

TEST_CASE("Bad trial lines name the line and the field", "[audit][trials]") {
  const std::string good = R"({"route":"r","treatment":"T0","context_tokens":10,"ttft_ms":1,"pair_id":null})";
  CHECK_THAT(
      error_of(good + "\n" + R"({"route":"r","treatment":"T0","context_tokens":10,"ttft_ms":"fast","pair_id":null})"),
      Contains("t.jsonl line 2: field 'ttft_ms': expected a non-negative number, got \"fast\""));
  CHECK_THAT(error_of(R"({"route":"r","treatment":"T0","ttft_ms":1,"pair_id":null})"),
             Contains("line 1: field 'context_tokens': expected a non-negative integer, got nothing"));
  CHECK_THAT(error_of(R"({"route":"r","treatment":"T0","context_tokens":-5,"ttft_ms":1,"pair_id":null})"),
             Contains("field 'context_tokens'"));
  CHECK_THAT(error_of(R"({"route":"r","treatment":"T0","context_tokens":5,"ttft_ms":1})"),
             Contains("field 'pair_id': expected a string, an integer or null, got nothing"));
  CHECK_THAT(error_of(R"({"route":"","treatment":"T0","context_tokens":5,"ttft_ms":1,"pair_id":null})"),
             Contains("field 'route': expected a non-empty string"));
  CHECK_THAT(error_of(good + "\n\n{not json"), Contains("t.jsonl line 3: not a JSON object"));
  CHECK_THAT(error_of("[1,2]"), Contains("line 1: not a JSON object"));
  CHECK_THAT(error_of(R"({"route":"r","treatment":"T0","context_tokens":5,"ttft_ms":1,"pair_id":null,"span":"half"})"),
             Contains("field 'span': expected none, prompt, generated or all"));
  CHECK_THAT(error_of(R"({"event":"guess","route":"r"})"), Contains("field 'event'"));
  CHECK_THAT(error_of(R"({"event":"outcome","ttft_ms":3})"), Contains("field 'request_id'"));
}

TEST_CASE("Online assignments join their outcomes by request id", "[audit][trials]") {
  Trial assigned;
  assigned.route = "r";
  assigned.treatment = "T1";
  assigned.context_tokens = 300;
  assigned.request_id = "req-1";
  Trial unfinished = assigned;
  unfinished.request_id = "req-2";
  Trial failed = assigned;
  failed.request_id = "req-3";
  const std::string text = assignment_line(assigned) + "\n" + assignment_line(unfinished) + "\n" +
                           assignment_line(failed) + "\n" + outcome_line({"req-1", 8.5, 20.0, 200}) + "\n" +
                           outcome_line({"req-3", 1.0, 1.0, 502}) + "\n";
  const auto assignment = nlohmann::json::parse(assignment_line(assigned));
  CHECK_FALSE(assignment.contains("ttft_ms"));  // written before the outcome exists
  const auto parsed = parse_trials(text);
  REQUIRE(parsed);
  REQUIRE(parsed.value().trials.size() == 1);
  CHECK(parsed.value().trials[0].request_id == "req-1");
  CHECK(parsed.value().trials[0].ttft_ms == 8.5);
  CHECK(parsed.value().trials[0].e2e_ms == 20.0);
  CHECK(parsed.value().assignments_without_outcome == 1);
  CHECK(parsed.value().failed_outcomes == 1);
}

TEST_CASE("Treatments: the standard set and the policy's spelling share one type", "[audit][trials]") {
  const auto standard = standard_treatments("kv_int8");
  REQUIRE(standard.size() == 4);
  CHECK(standard[0] == Treatment{"T0", "tokens", kvrelay::KvSpan::kNone, std::nullopt});
  CHECK(standard[1].span == kvrelay::KvSpan::kPrompt);
  CHECK(standard[3].medium == "kv_int8");
  // The policy's default set is the same type, over kv_raw.
  CHECK(kvrelay::default_audit_treatments() == standard_treatments("kv_raw"));
  CHECK(is_known_span("all"));
  CHECK_FALSE(is_known_span("most"));
}

TEST_CASE("The audit trials record the treatment delivered next to the one assigned", "[audit][trials]") {
  Trial trial;
  trial.route = "r";
  trial.treatment = "T3";
  trial.context_tokens = 2000;
  trial.ttft_ms = 80.0;
  trial.delivered_treatment = "T0";
  trial.delivery_reason = "lookup_miss";
  const auto line = nlohmann::json::parse(trial_line(trial));
  CHECK(line["delivered_treatment"] == "T0");
  CHECK(line["delivery_reason"] == "lookup_miss");
  const std::string as_assigned = R"({"route":"r","treatment":"T1","context_tokens":10,"ttft_ms":1,"pair_id":null})";
  const auto parsed = parse_trials(trial_line(trial) + "\n" + as_assigned);
  REQUIRE(parsed);
  const auto& back = parsed.value().trials;
  CHECK(back[0].treatment == "T3");
  CHECK(back[0].delivered_treatment == "T0");
  CHECK(back[0].delivery_reason == "lookup_miss");
  CHECK(delivered_treatment_of(back[0]) == "T0");
  CHECK_FALSE(delivered_as_assigned(back[0]));
  // Absent (or null) is delivered as assigned.
  CHECK_FALSE(back[1].delivered_treatment);
  CHECK(delivered_treatment_of(back[1]) == "T1");
  CHECK(delivered_as_assigned(back[1]));

  // The two-record form: delivery travels in the outcome, never in the assignment.
  Trial assigned;
  assigned.route = "r";
  assigned.treatment = "T2";
  assigned.context_tokens = 300;
  assigned.request_id = "req-9";
  assigned.delivered_treatment = "T0";  // not known at assignment: left out of the record
  const auto assignment = nlohmann::json::parse(assignment_line(assigned));
  CHECK_FALSE(assignment.contains("delivered_treatment"));
  OutcomeRecord outcome{"req-9", 7.0, 9.0, 200, 310, 0, "T0", "span_refused"};
  const auto outcome_json = nlohmann::json::parse(outcome_line(outcome));
  CHECK(outcome_json["event"] == "outcome");
  CHECK(outcome_json["prompt_tokens"] == 310);
  CHECK(outcome_json["cached_tokens"] == 0);
  CHECK(outcome_json["delivered_treatment"] == "T0");
  CHECK(outcome_json["delivery_reason"] == "span_refused");
  CHECK_FALSE(nlohmann::json::parse(outcome_line({"req-1", 1.0, 2.0, 200})).contains("delivered_treatment"));
  const auto joined = parse_trials(assignment_line(assigned) + "\n" + outcome_line(outcome) + "\n");
  REQUIRE(joined);
  REQUIRE(joined.value().trials.size() == 1);
  CHECK(joined.value().trials[0].treatment == "T2");
  CHECK(joined.value().trials[0].delivered_treatment == "T0");
  CHECK(joined.value().trials[0].delivery_reason == "span_refused");
  CHECK(joined.value().trials[0].cached_tokens == 0U);
}

TEST_CASE("Bad delivery fields in audit trials name the line and the field", "[audit][trials]") {
  const std::string base = R"({"route":"r","treatment":"T3","context_tokens":10,"ttft_ms":1,"pair_id":null,)";
  CHECK_THAT(error_of(base + R"("delivered_treatment":3})"),
             Contains("t.jsonl line 1: field 'delivered_treatment': expected a non-empty string, got 3"));
  CHECK_THAT(error_of(base + R"("delivered_treatment":""})"),
             Contains("field 'delivered_treatment': expected a non-empty string, got \"\""));
  CHECK_THAT(error_of(base + R"("delivered_treatment":"T0","delivery_reason":["miss"]})"),
             Contains("field 'delivery_reason': expected a non-empty string, got [\"miss\"]"));
  CHECK(parse_trials(base + R"("delivered_treatment":null})"));
  CHECK_THAT(error_of(R"({"event":"assignment","request_id":"q","route":"r","treatment":"T3","context_tokens":10,)"
                      R"("pair_id":null,"delivered_treatment":"T0"})"),
             Contains("line 1: field 'delivered_treatment': expected nothing on an assignment record"));
  CHECK_THAT(error_of(R"({"event":"outcome","request_id":"q","ttft_ms":3,"delivered_treatment":false})"),
             Contains("line 1: field 'delivered_treatment': expected a non-empty string, got false"));
}
