#pragma once

// `kvrelay admin`'s human output (docs/admin-cli.md): the admin API's JSON as tables and one-line
// decisions. Every string from the daemon is printed with its control characters replaced, since
// route names, agent ids and upstream errors may be chosen by someone other than the operator.

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace kvrelay::cli {

// `text` with control characters (bytes below 0x20, 0x7f, and C1 controls in UTF-8) shown as '?',
// so that it cannot move a terminal's cursor or recolour it.
[[nodiscard]] std::string printable(std::string_view text);

// Columns padded to their widest cell, two spaces apart; one line each, header first.
[[nodiscard]] std::string render_table(const std::vector<std::string>& header,
                                       const std::vector<std::vector<std::string>>& rows);

// GET /admin/routes joined with GET /admin/decisions/last's `routes` (an object by route id).
[[nodiscard]] std::string routes_table(const nlohmann::json& routes, const nlohmann::json& last_by_route);
// One route as PUT /admin/routes/{id} answers it.
[[nodiscard]] std::string route_line(const nlohmann::json& route);
// One decision of GET /admin/decisions: seq, time, kind, route, medium, outcome, cost terms.
[[nodiscard]] std::string decision_line(const nlohmann::json& decision);
[[nodiscard]] std::string peers_table(const nlohmann::json& peers);
[[nodiscard]] std::string kv_report(const nlohmann::json& kv);
[[nodiscard]] std::string reload_report(const nlohmann::json& reload);

}  // namespace kvrelay::cli
