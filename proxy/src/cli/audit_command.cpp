#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/audit/analysis.h"
#include "kvrelay/audit/calibrate.h"
#include "kvrelay/audit/render.h"
#include "kvrelay/core/file_io.h"

#include "audit_run.h"
#include "commands.h"

namespace kvrelay::cli {

namespace {

struct AnalyzeOptions {
  std::string trials_file;
  std::string format = "json";
  std::string out;
  std::vector<std::uint64_t> buckets{256, 1024};
  std::string baseline = "T0";
  std::string route;
  std::size_t bootstrap = 2000;
  std::uint64_t seed = 1;
};

struct CalibrateOptions {
  std::string trials_file;
  std::string out;
  std::string baseline = "T0";
  std::size_t min_trials = 3;
};

int emit(const std::string& text, const std::string& out) {
  if (out.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (auto written = write_file_atomically(out, text); !written) {
    std::fprintf(stderr, "kvrelay audit: %s\n", written.error().to_string().c_str());
    return 1;
  }
  return 0;
}

int analyze(const AnalyzeOptions& options) {
  auto trials = audit::read_trials_file(options.trials_file);
  if (!trials) {
    std::fprintf(stderr, "kvrelay audit analyze: %s\n", trials.error().message.c_str());
    return 1;
  }
  audit::AnalysisOptions analysis;
  analysis.bucket_edges = options.buckets;
  analysis.baseline = options.baseline;
  analysis.route = options.route;
  analysis.bootstrap = {options.bootstrap, options.seed};
  auto report = audit::analyze(trials.value(), analysis);
  if (!report) {
    std::fprintf(stderr, "kvrelay audit analyze: %s: %s\n", options.trials_file.c_str(),
                 report.error().message.c_str());
    return 1;
  }
  if (report.value().trials == 0) {
    std::fprintf(stderr, "kvrelay audit analyze: %s: no trials%s\n", options.trials_file.c_str(),
                 options.route.empty() ? "" : " on that route");
    return 1;
  }
  if (options.format == "markdown") return emit(audit::render_markdown(report.value()), options.out);
  if (options.format == "svg") return emit(audit::render_svg(report.value(), trials.value(), analysis), options.out);
  return emit(audit::report_to_json(report.value()).dump(2) + "\n", options.out);
}

int calibrate(const CalibrateOptions& options) {
  auto trials = audit::read_trials_file(options.trials_file);
  if (!trials) {
    std::fprintf(stderr, "kvrelay audit calibrate: %s\n", trials.error().message.c_str());
    return 1;
  }
  audit::CalibrationOptions calibration;
  calibration.baseline = options.baseline;
  calibration.min_trials = options.min_trials;
  const auto fragment = audit::calibrate(trials.value(), calibration);
  return emit(fragment.dump(2) + "\n", options.out);
}

}  // namespace

void add_audit_command(CLI::App& app, int& exit_code) {
  auto* command =
      app.add_subcommand("audit", "Causal audit: analyse trials, calibrate the cost model, replay contexts");
  command->require_subcommand(1);

  auto analyze_options = std::make_shared<AnalyzeOptions>();
  auto* analyze_command = command->add_subcommand(
      "analyze", "Effects of each treatment vs the baseline per stratum and overall, with CIs and p-values");
  analyze_command->add_option("--trials", analyze_options->trials_file, "Trials file (JSON lines, docs/audit.md)")
      ->required();
  analyze_command->add_option("--format", analyze_options->format, "Report format")
      ->check(CLI::IsMember({"json", "markdown", "svg"}));
  analyze_command->add_option("--out", analyze_options->out, "Write the report here instead of stdout");
  analyze_command->add_option("--buckets", analyze_options->buckets, "Length bucket edges in tokens (256,1024)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  analyze_command->add_option("--baseline", analyze_options->baseline, "Baseline treatment");
  analyze_command->add_option("--route", analyze_options->route, "Only this route's trials");
  analyze_command->add_option("--bootstrap", analyze_options->bootstrap, "Bootstrap resamples (0: none)")
      ->check(CLI::Range(0, 1'000'000));
  analyze_command->add_option("--seed", analyze_options->seed, "Bootstrap seed");
  analyze_command->callback([analyze_options, &exit_code] { exit_code = analyze(*analyze_options); });

  auto calibrate_options = std::make_shared<CalibrateOptions>();
  auto* calibrate_command = command->add_subcommand(
      "calibrate", "Cost-model parameters from trials, as a policy fragment to review and apply with a reload");
  calibrate_command->add_option("--trials", calibrate_options->trials_file, "Trials file (JSON lines)")->required();
  calibrate_command->add_option("--out", calibrate_options->out, "Write the fragment here instead of stdout");
  calibrate_command->add_option("--baseline", calibrate_options->baseline, "Treatment that moves tokens only");
  calibrate_command->add_option("--min-trials", calibrate_options->min_trials, "Trials needed per parameter")
      ->check(CLI::Range(2, 1'000'000));
  calibrate_command->callback([calibrate_options, &exit_code] { exit_code = calibrate(*calibrate_options); });

  add_audit_run_command(*command, exit_code);
}

}  // namespace kvrelay::cli
