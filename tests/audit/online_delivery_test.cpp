// The daemon's online audit records what each trial was delivered next to what it was assigned
// (issue #28): in the outcome record of the trials file, in the in-memory trials the admin report
// analyses, and as a running count.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "kvrelay/audit/trials.h"
#include "kvrelay/proxy/online_audit.h"

#include "support/test_paths.h"

using namespace kvrelay::proxy;
using nlohmann::json;

namespace {

kvrelay::RoutePolicy audited_route(std::string trials_file) {
  kvrelay::RoutePolicy route;
  route.id = "a-to-b";
  route.from_agent = "a";
  route.to_agent = "b";
  route.audit.fraction = 1.0;
  route.audit.treatments = kvrelay::default_audit_treatments();
  route.audit.trials_file = std::move(trials_file);
  return route;
}

std::vector<json> lines_of(const std::string& text) {
  std::vector<json> out;
  std::istringstream stream(text);
  std::string line;
  while (std::getline(stream, line)) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

}  // namespace

TEST_CASE("online audit records the treatment delivered in the outcome and counts the differing ones",
          "[audit][online][delivery]") {
  kvrelay::test::TempDir dir;
  const auto path = (dir / "trials.jsonl").string();
  OnlineAudit audit(1000, 3);
  const auto route = audited_route(path);
  const auto treatments = kvrelay::default_audit_treatments();
  kvrelay::audit::Trial covariates;
  covariates.context_tokens = 1200;
  audit.record_assignment(route, "miss", treatments[3], covariates);    // T3, lookup missed
  audit.record_assignment(route, "silent", treatments[3], covariates);  // T3, delivered T0, no reason
  audit.record_assignment(route, "as-assigned", treatments[3], covariates);
  audit.record_assignment(route, "explicit", treatments[0], covariates);  // T0, reported as T0
  audit.record_assignment(route, "failed", treatments[2], covariates);    // non-2xx: not a trial

  AuditOutcome miss{40.0, 60.0, 200, 1200, 0};
  miss.delivered_treatment = "T0";
  miss.delivery_reason = "lookup_miss";
  audit.record_outcome("miss", miss);
  AuditOutcome silent{41.0, 61.0, 200, {}, {}};
  silent.delivered_treatment = "T0";
  audit.record_outcome("silent", silent);
  audit.record_outcome("as-assigned", AuditOutcome{5.0, 25.0, 200, {}, 1100});
  AuditOutcome explicit_t0{42.0, 62.0, 200, {}, {}};
  explicit_t0.delivered_treatment = "T0";
  audit.record_outcome("explicit", explicit_t0);
  AuditOutcome failed{1.0, 1.0, 502, {}, {}};
  failed.delivered_treatment = "T0";
  failed.delivery_reason = "upstream_failed";
  audit.record_outcome("failed", failed);

  CHECK(audit.delivery_differing() == 2);  // miss and silent; the failed request is no trial

  // The file: assignments carry no delivery, outcomes do.
  const auto lines = lines_of(kvrelay::test::read_file(path));
  REQUIRE(lines.size() == 10);
  for (const auto& line : lines) {
    if (line["event"] == "assignment") {
      CHECK_FALSE(line.contains("delivered_treatment"));
      CHECK_FALSE(line.contains("delivery_reason"));
    }
  }
  const auto outcome_of = [&](const std::string& id) {
    for (const auto& line : lines) {
      if (line["event"] == "outcome" && line["request_id"] == id) return line;
    }
    FAIL("no outcome for " << id);
    return json();
  };
  CHECK(outcome_of("miss")["delivered_treatment"] == "T0");
  CHECK(outcome_of("miss")["delivery_reason"] == "lookup_miss");
  CHECK(outcome_of("miss")["prompt_tokens"] == 1200);
  CHECK(outcome_of("silent")["delivery_reason"] == "unspecified");  // differing always says why
  CHECK_FALSE(outcome_of("as-assigned").contains("delivered_treatment"));
  CHECK(outcome_of("explicit")["delivered_treatment"] == "T0");
  CHECK_FALSE(outcome_of("explicit").contains("delivery_reason"));
  CHECK(outcome_of("failed")["delivery_reason"] == "upstream_failed");

  // Memory and file agree.
  const auto in_memory = audit.snapshot();
  const auto from_file = kvrelay::audit::read_trials_file(path);
  REQUIRE(from_file);
  for (const auto* set : {&in_memory, &from_file.value()}) {
    REQUIRE(set->trials.size() == 4);
    CHECK(set->failed_outcomes == 1);
    std::size_t differing = 0;
    for (const auto& trial : set->trials) {
      if (kvrelay::audit::delivered_as_assigned(trial)) continue;
      ++differing;
      CHECK(trial.treatment == "T3");
      CHECK(trial.delivered_treatment == "T0");
      CHECK_FALSE(trial.delivery_reason.empty());
    }
    CHECK(differing == 2);
  }

  // The admin report: the analysis' delivery counts plus the running total.
  kvrelay::audit::AnalysisOptions options;
  options.bootstrap.resamples = 0;
  const auto report = audit.report(options);
  CHECK(report["delivery_differing_total"] == 2);
  CHECK(report["delivery"]["differing"] == 2);
  CHECK(report["delivery"]["by_assigned"]["T3"]["delivered"]["T0"] == 2);
  CHECK(report["delivery"]["by_assigned"]["T3"]["reasons"]["lookup_miss"] == 1);
  CHECK(report["delivery"]["by_assigned"]["T3"]["reasons"]["unspecified"] == 1);
  CHECK(report["as_treated"]["same_as_intent_to_treat"] == false);
}
