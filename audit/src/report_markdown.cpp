#include <fmt/format.h>

#include <cmath>

#include "kvrelay/audit/render.h"

namespace kvrelay::audit {

namespace {

std::string figure(double value, int decimals = 2) {
  return std::isfinite(value) ? fmt::format("{:.{}f}", value, decimals) : std::string("n/a");
}

std::string p_value(double value) {
  if (!std::isfinite(value)) return "n/a";
  return value < 1e-4 ? fmt::format("{:.1e}", value) : fmt::format("{:.4f}", value);
}

std::string interval_text(const Interval& value) {
  return fmt::format("[{}, {}]", figure(value.low), figure(value.high));
}

// Table cells are escaped so a treatment or model name cannot break the table.
std::string cell(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

void effects_table(std::string& out, const std::vector<Effect>& effects) {
  out +=
      "| treatment | n | design | mean diff ms | 95% CI | change | p | p (Holm) | median diff ms | bootstrap CI | "
      "p Wilcoxon |\n";
  out += "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& effect : effects) {
    const auto& t = effect.t_test;
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {}% | {} | {} | {} | {} | {} |\n", cell(effect.treatment), effect.n,
        effect.paired ? "paired" : "Welch", t ? figure(t->difference) : "n/a", t ? interval_text(t->ci95) : "n/a",
        figure(effect.pct_change, 1), t ? p_value(t->p_value) : "n/a", effect.p_holm ? p_value(*effect.p_holm) : "n/a",
        figure(effect.median_diff_ms), effect.bootstrap ? interval_text(effect.bootstrap->mean_difference) : "n/a",
        effect.wilcoxon ? p_value(effect.wilcoxon->p_value) : "n/a");
  }
}

}  // namespace

std::string render_markdown(const AuditReport& report) {
  std::string out = "# kvrelay audit report\n\n";
  out += fmt::format("{} trials on route(s) {}; treatments {}; baseline {}.", report.trials,
                     cell(fmt::format("{}", fmt::join(report.routes, ", "))),
                     cell(fmt::format("{}", fmt::join(report.treatments, ", "))), cell(report.baseline));
  if (report.assignments_without_outcome > 0 || report.failed_outcomes > 0) {
    out += fmt::format(" {} assignments had no outcome and {} failed; they are left out.",
                       report.assignments_without_outcome, report.failed_outcomes);
  }
  out += "\nDifferences are treatment minus baseline time to first token (negative: the treatment is faster).\n\n";
  out += "## Overall (strata weighted by size)\n\n";
  effects_table(out, report.overall);
  for (const auto& stratum : report.strata) {
    out += fmt::format("\n## Stratum {} ({} trials)\n\n", cell(stratum.name), stratum.trials);
    if (stratum.effects.empty()) {
      out += "No comparison: the baseline or every other treatment is missing here.\n";
      continue;
    }
    effects_table(out, stratum.effects);
  }
  out += "\n## Break-even length\n\n";
  if (report.break_even.empty()) {
    out += "Not enough trials (3 per treatment and two lengths) to fit latency against length.\n";
    return out;
  }
  out += "| model pair | treatment | outcome | break-even tokens | 95% CI | bootstrap agreement |\n";
  out += "|---|---|---|---|---|---|\n";
  for (const auto& estimate : report.break_even) {
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {}% |\n", cell(estimate.model_pair), cell(estimate.treatment),
        crossing_kind_name(estimate.kind), estimate.break_even_tokens ? figure(*estimate.break_even_tokens, 0) : "-",
        estimate.ci95 ? interval_text(*estimate.ci95) : "-", figure(100.0 * estimate.bootstrap_agreement, 0));
  }
  return out;
}

}  // namespace kvrelay::audit
