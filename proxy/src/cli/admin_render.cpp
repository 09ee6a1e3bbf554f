#include "admin_render.h"

#include <fmt/format.h>

#include <algorithm>
#include <ctime>

namespace kvrelay::cli {

namespace {

using nlohmann::json;

// A field as text: strings as they are (printable), numbers and booleans as JSON writes them,
// absent or null as `missing`.
std::string field_text(const json& object, std::string_view key, std::string_view missing = "-") {
  if (!object.is_object()) return std::string(missing);
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::string(missing);
  if (it->is_string()) return printable(it->get_ref<const std::string&>());
  if (it->is_boolean()) return it->get<bool>() ? "yes" : "no";
  if (it->is_number_float()) return fmt::format("{:g}", it->get<double>());
  return printable(it->dump());
}

std::optional<double> number_at(const json& object, std::string_view key) {
  if (!object.is_object()) return std::nullopt;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

// Milliseconds with three significant digits at most, without exponents.
std::string milliseconds_text(double ms) {
  if (ms >= 100.0) return fmt::format("{:.0f}", ms);
  if (ms >= 10.0) return fmt::format("{:.1f}", ms);
  return fmt::format("{:.2f}", ms);
}

std::string bytes_text(double bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t unit = 0;
  while (bytes >= 1024.0 && unit + 1 < std::size(kUnits)) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, kUnits[unit]);
}

std::string local_time_text(double unix_ms) {
  const auto seconds = static_cast<std::time_t>(unix_ms / 1000.0);
  std::tm parts{};
  if (localtime_r(&seconds, &parts) == nullptr) return "-";
  const auto millis = static_cast<int>(unix_ms - static_cast<double>(seconds) * 1000.0);
  return fmt::format("{:02}:{:02}:{:02}.{:03}", parts.tm_hour, parts.tm_min, parts.tm_sec, std::clamp(millis, 0, 999));
}

std::string joined(const json& list) {
  if (!list.is_array() || list.empty()) return "-";
  std::string out;
  for (const auto& item : list) {
    if (!out.empty()) out += ", ";
    out += item.is_string() ? printable(item.get_ref<const std::string&>()) : printable(item.dump());
  }
  return out;
}

// The decision's cost terms: the chosen medium's breakdown, then the other eligible candidates'
// totals ("" without a breakdown, as for a forced medium on a node without an engine).
std::string cost_text(const json& decision) {
  const auto cost = decision.find("cost");
  if (cost == decision.end() || !cost->is_object()) return {};
  const auto candidates = cost->find("candidates");
  if (candidates == cost->end() || !candidates->is_array()) return {};
  std::string chosen = field_text(decision, "medium", "");
  if (chosen.empty()) chosen = field_text(*cost, "chosen", "");
  std::string chosen_terms;
  std::string others;
  for (const auto& candidate : *candidates) {
    if (!candidate.is_object()) continue;
    const auto medium = field_text(candidate, "medium");
    const auto total = number_at(candidate, "total_s");
    if (medium == chosen && total) {
      chosen_terms =
          fmt::format("cost {} {} ms = comm {} + codec {} + comp {} + loss {}", medium, milliseconds_text(*total * 1e3),
                      milliseconds_text(number_at(candidate, "c_comm_s").value_or(0.0) * 1e3),
                      milliseconds_text(number_at(candidate, "c_codec_s").value_or(0.0) * 1e3),
                      milliseconds_text(number_at(candidate, "c_comp_s").value_or(0.0) * 1e3),
                      milliseconds_text(number_at(candidate, "c_loss_s").value_or(0.0) * 1e3));
      if (const auto audit = number_at(candidate, "audit_correction_s"); audit && *audit != 0.0) {
        chosen_terms += fmt::format(" + audit {}", milliseconds_text(*audit * 1e3));
      }
    } else if (const auto eligible = candidate.find("eligible");
               total && (eligible == candidate.end() || !eligible->is_boolean() || eligible->get<bool>())) {
      others += fmt::format("{}{} {} ms", others.empty() ? "" : ", ", medium, milliseconds_text(*total * 1e3));
    }
  }
  if (chosen_terms.empty()) chosen_terms = fmt::format("cost {} -", chosen.empty() ? "?" : chosen);
  return others.empty() ? chosen_terms : chosen_terms + " | " + others;
}

std::string ttft_text(const json& route) {
  const auto ttft = route.find("recent_ttft");
  if (ttft == route.end() || !ttft->is_object()) return "-";
  if (const auto median = number_at(*ttft, "audited_median_ms")) {
    return fmt::format("{} ms (audited, n={})", milliseconds_text(*median), field_text(*ttft, "audited_samples"));
  }
  if (const auto engine = number_at(*ttft, "receiver_engine_mean_ms")) {
    return fmt::format("{} ms (engine)", milliseconds_text(*engine));
  }
  return "-";
}

}  // namespace

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t index = 0; index < text.size(); ++index) {
    const auto byte = static_cast<unsigned char>(text[index]);
    const auto next = index + 1 < text.size() ? static_cast<unsigned char>(text[index + 1]) : 0U;
    if (byte == 0xc2 && next >= 0x80 && next <= 0x9f) {
      out.push_back('?');  // a C1 control in UTF-8 (U+009B is a CSI to some terminals)
      ++index;
    } else {
      out.push_back(byte < 0x20 || byte == 0x7f ? '?' : text[index]);
    }
  }
  return out;
}

std::string render_table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths(header.size(), 0);
  const auto widen = [&widths](const std::vector<std::string>& cells) {
    for (std::size_t column = 0; column < cells.size() && column < widths.size(); ++column)
      widths[column] = std::max(widths[column], cells[column].size());
  };
  widen(header);
  for (const auto& row : rows)
    widen(row);
  std::string out;
  const auto line = [&](const std::vector<std::string>& cells) {
    std::string text;
    for (std::size_t column = 0; column < widths.size(); ++column) {
      const std::string& cell = column < cells.size() ? cells[column] : std::string();
      text += cell;
      if (column + 1 < widths.size()) text += std::string(widths[column] - cell.size() + 2, ' ');
    }
    while (!text.empty() && text.back() == ' ')
      text.pop_back();
    out += text + '\n';
  };
  line(header);
  for (const auto& row : rows)
    line(row);
  return out;
}

std::string routes_table(const json& routes, const json& last_by_route) {
  std::vector<std::vector<std::string>> rows;
  const auto list = routes.find("routes");
  if (list != routes.end() && list->is_array()) {
    for (const auto& route : *list) {
      const auto id_field = route.is_object() ? route.find("id") : route.end();
      const std::string id =
          id_field != route.end() && id_field->is_string() ? id_field->get<std::string>() : std::string();
      std::string last = "-";
      if (last_by_route.is_object()) {
        if (const auto found = last_by_route.find(id); found != last_by_route.end() && found->is_object()) {
          last = field_text(*found, "medium");
          if (found->contains("source")) last += " (" + field_text(*found, "source") + ")";
        }
      }
      rows.push_back({printable(id), field_text(route, "from"), field_text(route, "to"), field_text(route, "enabled"),
                      field_text(route, "forced_medium"), last, field_text(route, "audit_fraction"), ttft_text(route)});
    }
  }
  if (rows.empty()) return "no routes in the policy\n";
  return render_table({"ROUTE", "FROM", "TO", "ENABLED", "FORCED", "LAST MEDIUM", "AUDIT", "RECENT TTFT"}, rows);
}

std::string route_line(const json& route) {
  return fmt::format("route {} ({} -> {}): enabled {}, forced medium {}, audit fraction {}\n", field_text(route, "id"),
                     field_text(route, "from"), field_text(route, "to"), field_text(route, "enabled"),
                     field_text(route, "forced_medium"), field_text(route, "audit_fraction"));
}

std::string decision_line(const json& decision) {
  if (!decision.is_object()) return printable(decision.dump()) + '\n';
  std::string line = "#" + field_text(decision, "seq", "?");
  if (const auto when = number_at(decision, "time_unix_ms")) line += " " + local_time_text(*when);
  line += " " + field_text(decision, "kind", "?");
  const auto add = [&line, &decision](std::string_view label, std::string_view key) {
    if (decision.contains(key) && !decision[std::string(key)].is_null()) {
      line += fmt::format(" {}={}", label, field_text(decision, key));
    }
  };
  add("event", "event");
  add("route", "route");
  add("agent", "agent");
  add("peer", "peer");
  add("to", "to_node");
  if (decision.contains("medium")) {
    line += " medium=" + field_text(decision, "medium");
    if (decision.contains("source")) line += "(" + field_text(decision, "source") + ")";
  }
  add("outcome", "outcome");
  if (const auto served = number_at(decision, "served_tokens")) {
    line += fmt::format(" served={:.0f}", *served);
    if (const auto prompt = number_at(decision, "prompt_tokens")) line += fmt::format("/{:.0f}", *prompt);
  }
  add("from", "kv_from");
  add("error", "error");
  if (const auto cost = cost_text(decision); !cost.empty()) line += "  " + cost;
  return line + '\n';
}

std::string peers_table(const json& peers) {
  std::string out = fmt::format("node {}, peer TLS {}\n", field_text(peers, "node"), field_text(peers, "tls"));
  std::vector<std::vector<std::string>> rows;
  const auto list = peers.find("peers");
  if (list != peers.end() && list->is_array()) {
    for (const auto& peer : *list) {
      const json link = peer.is_object() ? peer.value("link", json::object()) : json::object();
      const auto rtt = number_at(link, "rtt_us");
      const auto throughput = number_at(link, "throughput_bytes_per_s");
      std::string summary = "-";
      if (const auto keys = number_at(peer, "summary_keys")) {
        summary = fmt::format("{:.0f} keys", *keys);
        if (const auto age = number_at(peer, "summary_age_s")) summary += fmt::format(", {:.1f} s old", *age);
      }
      rows.push_back({field_text(peer, "id"), field_text(peer, "address"), field_text(peer, "transport"),
                      field_text(peer, "state"), rtt ? milliseconds_text(*rtt / 1e3) + " ms" : "-",
                      throughput ? bytes_text(*throughput) + "/s" : "-", summary, field_text(peer, "fetches"),
                      field_text(peer, "pushes"), field_text(peer, "failures"), field_text(peer, "last_error")});
    }
  }
  if (rows.empty()) return out + "no peers in the policy\n";
  return out + render_table({"PEER", "ADDRESS", "TRANSPORT", "STATE", "RTT", "THROUGHPUT", "SUMMARY", "FETCHES",
                             "PUSHES", "FAILURES", "LAST ERROR"},
                            rows);
}

std::string kv_report(const json& kv) {
  const double budget = number_at(kv, "budget_bytes").value_or(0.0);
  const double used = number_at(kv, "used_bytes").value_or(0.0);
  std::string out =
      fmt::format("store: {} used of {} ({:.1f}%), {} entries, eviction {}\n", bytes_text(used), bytes_text(budget),
                  budget > 0.0 ? 100.0 * used / budget : 0.0, field_text(kv, "entries"), field_text(kv, "eviction"));
  const json evictions = kv.value("evictions", json::object());
  out += fmt::format("evictions: {} (budget {}, arena {}); refused downgrades {}\n", field_text(evictions, "total"),
                     field_text(evictions, "budget"), field_text(evictions, "arena"),
                     field_text(kv, "refused_downgrades"));
  const json spill = kv.value("spill", json::object());
  out += fmt::format("spill: {} stubs, {} spills, {} failures, {} spilled in ({} entries), {} fetch-backs\n",
                     field_text(spill, "stubs"), field_text(spill, "spills"), field_text(spill, "failures"),
                     bytes_text(number_at(spill, "spilled_in_bytes").value_or(0.0)),
                     field_text(spill, "spilled_in_entries"), field_text(spill, "fetch_backs"));
  const json prefetch = kv.value("prefetch", json::object());
  out += fmt::format("prefetch: {} sent, {} hits\n", field_text(prefetch, "sent"), field_text(prefetch, "hits"));
  std::vector<std::vector<std::string>> rows;
  const auto top = kv.find("top");
  if (top != kv.end() && top->is_array()) {
    for (const auto& entry : *top) {
      std::string fidelity = "exact";
      if (const auto it = entry.find("fidelity"); it != entry.end() && it->is_object()) {
        fidelity = "lossy " + field_text(*it, "lossy_codec");
      }
      const auto utility = number_at(entry, "utility");
      rows.push_back({field_text(entry, "key"), field_text(entry, "model_id"), field_text(entry, "tokens"),
                      bytes_text(number_at(entry, "bytes").value_or(0.0)), field_text(entry, "hits"),
                      utility ? fmt::format("{:.3g}", *utility) : "-", fidelity, field_text(entry, "origin")});
    }
  }
  if (rows.empty()) return out + "no entries\n";
  return out + "\n" + render_table({"KEY", "MODEL", "TOKENS", "BYTES", "HITS", "UTILITY", "FIDELITY", "ORIGIN"}, rows);
}

std::string reload_report(const json& reload) {
  std::string out = "reload: " + field_text(reload, "status") + '\n';
  out += "live: " + joined(reload.value("live", json::array())) + '\n';
  out += "restart required: " + joined(reload.value("restart_required", json::array())) + '\n';
  const json overrides = reload.value("live_route_overrides", json::object());
  out += fmt::format("live route changes: kept {}; replaced {}\n", joined(overrides.value("kept", json::array())),
                     joined(overrides.value("replaced", json::array())));
  out += "engine: " + field_text(reload, "engine");
  if (reload.contains("engine_note")) out += " (" + field_text(reload, "engine_note") + ")";
  if (reload.contains("engine_error")) out += " (" + field_text(reload, "engine_error") + ")";
  return out + '\n';
}

}  // namespace kvrelay::cli
