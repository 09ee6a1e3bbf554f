// `kvrelay audit run`: the options of the offline runner (audit/offline_runner.h), then the
// analysis of its trials, printed as JSON.

#include "audit_run.h"

#include <cstdio>
#include <memory>
#include <string>

#include "kvrelay/audit/analysis.h"
#include "kvrelay/audit/offline_runner.h"
#include "kvrelay/audit/render.h"

namespace kvrelay::cli {

namespace {

struct RunOptions {
  audit::OfflineRunOptions runner;
  std::size_t bootstrap = 2000;
};

int run(const RunOptions& options) {
  const auto report_error = [](const std::string& message) {
    std::fprintf(stderr, "kvrelay audit run: %s\n", message.c_str());
    return 1;
  };
  auto trials = audit::run_offline_audit(options.runner);
  if (!trials) return report_error(trials.error().message);
  audit::AnalysisOptions analysis;
  analysis.bootstrap = {options.bootstrap, options.runner.seed};
  auto report = audit::analyze(trials.value(), analysis);
  if (!report) return report_error(report.error().message);
  std::printf("%s\n", audit::report_to_json(report.value()).dump(2).c_str());
  return 0;
}

}  // namespace

void add_audit_run_command(CLI::App& audit_command, int& exit_code) {
  auto options = std::make_shared<RunOptions>();
  auto* command = audit_command.add_subcommand(
      "run", "Replay contexts under every treatment (seeded random order, repeats) and analyse them as paired");
  command
      ->add_option("--contexts", options->runner.contexts_file,
                   "Contexts (JSON lines: {\"prompt\": [ids], \"a_followup\": [ids], \"b_followup\": [ids]})")
      ->required();
  command
      ->add_option("--sidecar", options->runner.sidecars,
                   "Sidecar front proxy URL; give two for A's and B's sidecars on different nodes")
      ->required()
      ->expected(1, 2);
  command->add_option("--agent-a", options->runner.agent_a, "Agent that answers the context first")->required();
  command->add_option("--agent-b", options->runner.agent_b, "Agent that receives A's context (its TTFT is measured)")
      ->required();
  command->add_option("--route", options->runner.route, "Route id recorded in the trials (default A-to-B)");
  command->add_option("--treatments", options->runner.treatments, "Treatments (T0,T1,T2,T3)")->delimiter(',');
  command->add_option("--kv-medium", options->runner.kv_medium, "Medium of the KV treatments (kv_raw, kv_int8, ...)");
  command->add_option("--repeats", options->runner.repeats, "Repeats of every context")->check(CLI::Range(1, 1000));
  command->add_option("--seed", options->runner.seed, "Seed of the treatment order and the bootstrap");
  command->add_option("--out", options->runner.out, "Trials file to write (JSON lines)")->required();
  command->add_option("--a-max-tokens", options->runner.a_max_tokens, "Tokens agent A generates")
      ->check(CLI::Range(1, 4096));
  command->add_option("--b-max-tokens", options->runner.b_max_tokens, "Tokens agent B generates")
      ->check(CLI::Range(1, 4096));
  command->add_option("--sender-model", options->runner.sender_model, "Model label of A (strata)");
  command->add_option("--receiver-model", options->runner.receiver_model, "Model label of B (strata)");
  command->add_option("--timeout-s", options->runner.timeout_s, "Per-request timeout")->check(CLI::Range(0.1, 3600.0));
  command->add_option("--bootstrap", options->bootstrap, "Bootstrap resamples of the final analysis")
      ->check(CLI::Range(0, 1'000'000));
  command->callback([options, &exit_code] { exit_code = run(*options); });
}

}  // namespace kvrelay::cli
