#pragma once

// The audit report for machines (JSON), people (Markdown) and plots (SVG).

#include <nlohmann/json_fwd.hpp>

#include <string>

#include "kvrelay/audit/analysis.h"
#include "kvrelay/audit/trials.h"

namespace kvrelay::audit {

// Per stratum and overall, each effect as {"treatment", "baseline", "n", "mean_diff_ms", "ci95",
// "pct_change", "p_value", "p_holm", "paired"} plus fields of their own for the rest
// (docs/audit.md). Figures that cannot be computed are null. "strata" and "overall" are the
// intent-to-treat effects (by assigned treatment); "delivery" counts what was delivered and
// "as_treated" holds the effects by delivered treatment with the selection checks.
[[nodiscard]] nlohmann::json report_to_json(const AuditReport& report);
[[nodiscard]] nlohmann::json effect_to_json(const Effect& effect);

[[nodiscard]] std::string render_markdown(const AuditReport& report);

// Latency against context length per treatment (points, mean per length with a 95% CI band,
// the fitted line) and each estimated break-even length marked; one panel per model pair.
[[nodiscard]] std::string render_svg(const AuditReport& report, const TrialSet& trials, const AnalysisOptions& options);

}  // namespace kvrelay::audit
