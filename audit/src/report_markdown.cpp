#include <fmt/format.h>

#include <cmath>
#include <string_view>
#include <vector>

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

void strata_tables(std::string& out, const std::vector<StratumReport>& strata, std::string_view label) {
  for (const auto& stratum : strata) {
    out += fmt::format("\n## {}Stratum {} ({} trials)\n\n", label, cell(stratum.name), stratum.trials);
    if (stratum.effects.empty()) {
      out += "No comparison: the baseline or every other treatment is missing here.\n";
      continue;
    }
    effects_table(out, stratum.effects);
  }
}

void delivery_section(std::string& out, const AuditReport& report) {
  const auto& as_treated = report.as_treated;
  out += "\n## As-treated (by delivered treatment)\n\n";
  if (as_treated.same_as_intent_to_treat) {
    out += as_treated.note + "\n";
    return;
  }
  out += fmt::format("As-treated estimate biased: {}.\n\n",
                     as_treated.biased ? "**likely** (read intent-to-treat)" : "no evidence");
  out += as_treated.note + "\n\n";
  out += "| assigned | trials | delivered as assigned | delivered | reasons (differing) |\n";
  out += "|---|---|---|---|---|\n";
  for (const auto& [assigned, counts] : report.delivery.by_assigned) {
    std::vector<std::string> delivered;
    for (const auto& [name, trials] : counts.delivered)
      delivered.push_back(fmt::format("{} {}", name, trials));
    std::vector<std::string> reasons;
    for (const auto& [reason, trials] : counts.reasons)
      reasons.push_back(fmt::format("{} {}", reason, trials));
    out += fmt::format("| {} | {} | {} | {} | {} |\n", cell(assigned), counts.assigned, counts.delivered_as_assigned,
                       cell(fmt::format("{}", fmt::join(delivered, ", "))),
                       reasons.empty() ? std::string("-") : cell(fmt::format("{}", fmt::join(reasons, ", "))));
  }
  if (!as_treated.selection.empty()) {
    out +=
        "\nSelection checks: trials assigned X but delivered Y against trials assigned and delivered Y (equal in "
        "distribution when non-delivery is independent of the outcome).\n\n";
    out += "| assigned | delivered | n selected | n reference | mean diff ms | 95% CI | p | p (Holm) | biased |\n";
    out += "|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& check : as_treated.selection) {
      const auto& t = check.test;
      out += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", cell(check.treatment),
                         cell(check.delivered), check.n_selected, check.n_reference, t ? figure(t->difference) : "n/a",
                         t ? interval_text(t->ci95) : "n/a", t ? p_value(t->p_value) : "n/a",
                         check.p_holm ? p_value(*check.p_holm) : "n/a", check.biased ? "yes" : "no");
    }
  }
  out += "\n## As-treated overall (by delivered treatment; strata weighted by size)\n\n";
  effects_table(out, as_treated.overall);
  strata_tables(out, as_treated.strata, "As-treated ");
}

void break_even_section(std::string& out, const AuditReport& report) {
  out += "\n## Break-even length (by assigned treatment)\n\n";
  if (report.break_even.empty()) {
    out += "Not enough trials (3 per treatment and two lengths) to fit latency against length.\n";
    return;
  }
  out += "| model pair | treatment | outcome | break-even tokens | 95% CI | bootstrap agreement |\n";
  out += "|---|---|---|---|---|---|\n";
  for (const auto& estimate : report.break_even) {
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {}% |\n", cell(estimate.model_pair), cell(estimate.treatment),
        crossing_kind_name(estimate.kind), estimate.break_even_tokens ? figure(*estimate.break_even_tokens, 0) : "-",
        estimate.ci95 ? interval_text(*estimate.ci95) : "-", figure(100.0 * estimate.bootstrap_agreement, 0));
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
  out += fmt::format(" {} trials were delivered other than assigned{}.", report.delivery.differing,
                     report.as_treated.biased ? " and the as-treated estimate is likely biased" : "");
  out += "\nDifferences are treatment minus baseline time to first token (negative: the treatment is faster).\n\n";
  out += "Intent-to-treat (trials grouped by the treatment they were assigned at random) comes first; the\n";
  out += "as-treated effects (grouped by the treatment delivered) follow.\n\n";
  out += "## Intent-to-treat overall (by assigned treatment; strata weighted by size)\n\n";
  effects_table(out, report.overall);
  strata_tables(out, report.strata, "");
  break_even_section(out, report);
  delivery_section(out, report);
  return out;
}

}  // namespace kvrelay::audit
