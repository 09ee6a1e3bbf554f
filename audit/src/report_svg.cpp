#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "kvrelay/audit/render.h"

namespace kvrelay::audit {

namespace {

constexpr double kPanelWidth = 720.0;
constexpr double kPanelHeight = 420.0;
constexpr double kMarginLeft = 70.0;
constexpr double kMarginRight = 150.0;
constexpr double kMarginTop = 40.0;
constexpr double kMarginBottom = 50.0;
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"};

std::string escape_xml(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t') out += c;
    }
  }
  return out;
}

struct Scale {
  double x_max = 1.0;
  double y_max = 1.0;
  double top = 0.0;
  [[nodiscard]] double x(double tokens) const {
    return kMarginLeft + tokens / x_max * (kPanelWidth - kMarginLeft - kMarginRight);
  }
  [[nodiscard]] double y(double ms) const {
    return top + kPanelHeight - kMarginBottom - ms / y_max * (kPanelHeight - kMarginTop - kMarginBottom);
  }
};

// Mean and a normal-approximation 95% band per distinct length: a visual guide; the report's
// intervals are the t and bootstrap ones.
struct LengthSummary {
  double tokens = 0.0;
  double mean = 0.0;
  double half_width = 0.0;
};

std::vector<LengthSummary> summarize_by_length(const std::vector<const Trial*>& trials) {
  std::map<std::uint64_t, std::vector<double>> by_length;
  for (const Trial* trial : trials)
    by_length[trial->context_tokens].push_back(trial->ttft_ms);
  std::vector<LengthSummary> out;
  for (const auto& [tokens, values] : by_length) {
    const double center = mean(values);
    const double half_width =
        values.size() > 1 ? 1.96 * std::sqrt(sample_variance(values) / static_cast<double>(values.size())) : 0.0;
    out.push_back({static_cast<double>(tokens), center, half_width});
  }
  return out;
}

std::string nice_number(double value) {
  if (value >= 100.0) return fmt::format("{:.0f}", value);
  if (value >= 1.0) return fmt::format("{:.1f}", value);
  return fmt::format("{:.3g}", value);
}

}  // namespace

std::string render_svg(const AuditReport& report, const TrialSet& trials, const AnalysisOptions& options) {
  std::map<std::string, std::map<std::string, std::vector<const Trial*>>> panels;
  for (const auto& trial : trials.trials) {
    if (!options.route.empty() && trial.route != options.route) continue;
    panels[model_pair_of(trial)][trial.treatment].push_back(&trial);
  }
  std::map<std::string, std::string> color_of;
  for (std::size_t i = 0; i < report.treatments.size(); ++i) {
    color_of[report.treatments[i]] = kColors[i % std::size(kColors)];
  }
  const double height = std::max<double>(1.0, static_cast<double>(panels.size())) * kPanelHeight;
  std::string out = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      kPanelWidth, height);
  if (panels.empty()) out += "<text x=\"20\" y=\"40\">no trials</text>\n";
  double top = 0.0;
  for (const auto& [pair, arms] : panels) {
    Scale scale;
    scale.top = top;
    for (const auto& [treatment, arm] : arms) {
      for (const Trial* trial : arm) {
        scale.x_max = std::max(scale.x_max, static_cast<double>(trial->context_tokens));
        scale.y_max = std::max(scale.y_max, trial->ttft_ms);
      }
    }
    scale.x_max *= 1.05;
    scale.y_max *= 1.1;
    out += fmt::format(
        "<g class=\"panel\"><text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"14\">Time to first token vs "
        "context length, {}</text>\n",
        kMarginLeft, top + 24.0, escape_xml(pair));
    const double x0 = scale.x(0.0);
    const double y0 = scale.y(0.0);
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"black\"/>\n", x0, y0,
                       scale.x(scale.x_max));
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"black\"/>\n", x0, y0,
                       scale.y(scale.y_max));
    for (int tick = 0; tick <= 4; ++tick) {
      const double tokens = scale.x_max * tick / 4.0;
      const double ms = scale.y_max * tick / 4.0;
      out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", scale.x(tokens),
                         y0 + 16.0, nice_number(tokens));
      out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", x0 - 6.0, scale.y(ms) + 4.0,
                         nice_number(ms));
    }
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">context tokens</text>\n",
                       (x0 + scale.x(scale.x_max)) / 2.0, y0 + 34.0);
    out += fmt::format(
        "<text x=\"16\" y=\"{:.1f}\" transform=\"rotate(-90 16 {:.1f})\" text-anchor=\"middle\">TTFT "
        "ms</text>\n",
        (y0 + scale.y(scale.y_max)) / 2.0, (y0 + scale.y(scale.y_max)) / 2.0);
    double legend_y = top + kMarginTop + 10.0;
    for (const auto& [treatment, arm] : arms) {
      const std::string color = color_of.contains(treatment) ? color_of[treatment] : "#333333";
      const auto summary = summarize_by_length(arm);
      std::string band_upper;
      std::string band_lower;
      std::string line;
      for (const auto& point : summary) {
        band_upper += fmt::format("{:.1f},{:.1f} ", scale.x(point.tokens), scale.y(point.mean + point.half_width));
        line += fmt::format("{:.1f},{:.1f} ", scale.x(point.tokens), scale.y(point.mean));
      }
      for (auto it = summary.rbegin(); it != summary.rend(); ++it) {
        band_lower +=
            fmt::format("{:.1f},{:.1f} ", scale.x(it->tokens), scale.y(std::max(0.0, it->mean - it->half_width)));
      }
      out += fmt::format("<g class=\"treatment\" data-treatment=\"{}\">\n", escape_xml(treatment));
      out += fmt::format(
          "<polygon class=\"ci-band\" points=\"{}{}\" fill=\"{}\" fill-opacity=\"0.18\" "
          "stroke=\"none\"/>\n",
          band_upper, band_lower, color);
      out += fmt::format("<polyline class=\"mean\" points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n",
                         line, color);
      for (const Trial* trial : arm) {
        out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2\" fill=\"{}\" fill-opacity=\"0.5\"/>\n",
                           scale.x(static_cast<double>(trial->context_tokens)), scale.y(trial->ttft_ms), color);
      }
      out += "</g>\n";
      out += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.1f}\" "
          "y=\"{:.1f}\">{}</text>\n",
          kPanelWidth - kMarginRight + 16.0, legend_y - 10.0, color, kPanelWidth - kMarginRight + 34.0, legend_y,
          escape_xml(treatment));
      legend_y += 18.0;
    }
    for (const auto& estimate : report.break_even) {
      if (estimate.model_pair != pair || !estimate.break_even_tokens) continue;
      const double tokens = *estimate.break_even_tokens;
      if (tokens > scale.x_max) continue;
      const std::string color = color_of.contains(estimate.treatment) ? color_of[estimate.treatment] : "#333333";
      if (estimate.ci95) {
        const double low = std::clamp(estimate.ci95->low, 0.0, scale.x_max);
        const double high = std::clamp(estimate.ci95->high, 0.0, scale.x_max);
        out += fmt::format(
            "<rect class=\"break-even-ci\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
            "fill=\"{}\" fill-opacity=\"0.08\"/>\n",
            scale.x(low), scale.y(scale.y_max), std::max(0.0, scale.x(high) - scale.x(low)), y0 - scale.y(scale.y_max),
            color);
      }
      out += fmt::format(
          "<line class=\"break-even\" x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" "
          "stroke=\"{3}\" stroke-dasharray=\"6,4\"/>\n"
          "<text x=\"{4:.1f}\" y=\"{5:.1f}\" fill=\"{3}\">{6} = {7} at {8:.0f} tokens</text>\n",
          scale.x(tokens), y0, scale.y(scale.y_max), color, scale.x(tokens) + 4.0, legend_y + 10.0,
          escape_xml(estimate.treatment), escape_xml(estimate.baseline), tokens);
      legend_y += 16.0;
    }
    out += "</g>\n";
    top += kPanelHeight;
  }
  out += "</svg>\n";
  return out;
}

}  // namespace kvrelay::audit
