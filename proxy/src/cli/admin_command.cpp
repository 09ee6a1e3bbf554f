// `kvrelay admin ...` (issue #30): the admin API from the command line. Each subcommand is one
// or two requests to the daemon's admin listener (admin_client.h), printed as a table
// (admin_render.h) or, with --json, as the JSON the daemon answered. docs/admin-cli.md is the
// reference; the exit codes say what failed (AdminExit).
//
// The `admin` subcommand takes its arguments unparsed and parses them itself, so that every
// usage error exits 2 (CLI11's own codes are 100 and up) and `--admin`, `--token-file` and
// `--json` can come before or after the subcommand's name.

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "admin_client.h"
#include "admin_render.h"
#include "commands.h"

namespace kvrelay::cli {

namespace {

using nlohmann::json;

// The admin listener of the policies under config/ (listen.admin), when neither --admin nor
// KVRELAY_ADMIN says otherwise.
constexpr const char* kDefaultAdminUrl = "http://127.0.0.1:8081";
constexpr std::size_t kMaxDecisionLimit = 1024;  // the daemon's decision ring

struct AdminCommonOptions {
  std::string admin_url;
  std::string token_file;
  bool json = false;
  double timeout_s = 10.0;
};

struct AdminSession {
  AdminConnection connection;
  bool json = false;
};

void print_error(std::string_view message) {
  std::cerr << "kvrelay admin: " << message << '\n';
}

// Text from the daemon on stderr: its lines kept, every other control character shown as '?'.
std::string printable_lines(std::string_view text) {
  std::string out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = text.find('\n', start);
    out += printable(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    out += '\n';
    start = end + 1;
  }
  return out;
}

void print_body(std::string_view body) {
  std::cout << body;
  if (body.empty() || body.back() != '\n') std::cout << '\n';
  std::cout.flush();
}

// A non-2xx answer: its JSON error on stderr (and, with --json, the body on stdout), and the
// exit code that says who refused what.
int report_refusal(const AdminSession& session, const AdminReply& reply) {
  const auto body = json::parse(reply.body, nullptr, false);
  std::string type;
  std::string message;
  if (body.is_object() && body.contains("error") && body["error"].is_object()) {
    const auto& error = body["error"];
    if (error.contains("type") && error["type"].is_string()) type = error["type"].get<std::string>();
    if (error.contains("message") && error["message"].is_string()) message = error["message"].get<std::string>();
  }
  if (session.json && !body.is_discarded()) print_body(reply.body);
  if (message.empty()) message = reply.body.substr(0, 512);
  std::string line = fmt::format("HTTP {}{}: {}", reply.status, type.empty() ? "" : " " + type, message);
  if (reply.status == 401) {
    line += "\n(pass the admin token with --token-file PATH or KVRELAY_ADMIN_TOKEN_FILE)";
  } else if (reply.status == 403) {
    line += "\n(the daemon has no admin token configured: its admin API is read-only; docs/security.md)";
  }
  print_error(printable_lines(line));
  if (reply.status == 401 || reply.status == 403) return exit_code_of(AdminExit::kUnauthorised);
  if (reply.status >= 400 && reply.status < 500) return exit_code_of(AdminExit::kRefused);
  return exit_code_of(AdminExit::kOther);
}

// One request. 0 and the reply for a 2xx answer; otherwise what went wrong is printed and its
// exit code returned.
int call_admin(const AdminSession& session, std::string_view method, const std::string& target, AdminReply& reply,
               std::string body = {}) {
  auto sent = send_admin_request(session.connection, method, target, std::move(body));
  if (!sent) {
    print_error(sent.error().message);
    return exit_code_of(sent.error().code == ErrorCode::kResourceExhausted ? AdminExit::kOther
                                                                           : AdminExit::kUnreachable);
  }
  reply = std::move(sent).value();
  if (reply.status < 200 || reply.status >= 300) return report_refusal(session, reply);
  return exit_code_of(AdminExit::kOk);
}

// As call_admin, with the answer parsed as a JSON object.
int call_admin_json(const AdminSession& session, std::string_view method, const std::string& target, AdminReply& reply,
                    json& parsed, std::string body = {}) {
  if (const int code = call_admin(session, method, target, reply, std::move(body)); code != 0) return code;
  parsed = json::parse(reply.body, nullptr, false);
  if (!parsed.is_object()) {
    print_error(fmt::format("{} {}: the answer is not a JSON object (content type '{}')", method, target,
                            printable(reply.content_type)));
    return exit_code_of(AdminExit::kOther);
  }
  return exit_code_of(AdminExit::kOk);
}

int run_routes(const AdminSession& session) {
  AdminReply reply;
  json routes;
  if (const int code = call_admin_json(session, "GET", "/admin/routes", reply, routes); code != 0) return code;
  json last = json::object();
  auto sent = send_admin_request(session.connection, "GET", "/admin/decisions/last");
  if (!sent) {
    print_error(sent.error().message);
    return exit_code_of(AdminExit::kUnreachable);
  }
  // 404: a daemon from before GET /admin/decisions/last, whose table shows no last medium.
  if (const auto& last_reply = sent.value(); last_reply.status != 404) {
    if (last_reply.status < 200 || last_reply.status >= 300) return report_refusal(session, last_reply);
    const auto parsed = json::parse(last_reply.body, nullptr, false);
    if (parsed.is_object() && parsed.contains("routes") && parsed["routes"].is_object()) last = parsed["routes"];
  }
  if (session.json) {
    if (routes.contains("routes") && routes["routes"].is_array()) {
      for (auto& route : routes["routes"]) {
        if (!route.is_object()) continue;
        const auto id = route.contains("id") && route["id"].is_string() ? route["id"].get<std::string>() : "";
        route["last_decision"] = last.contains(id) ? last[id] : json();
      }
    }
    print_body(routes.dump(-1, ' ', false, json::error_handler_t::replace));
    return exit_code_of(AdminExit::kOk);
  }
  std::cout << routes_table(routes, last) << std::flush;
  return exit_code_of(AdminExit::kOk);
}

struct RouteChange {
  std::string route;
  bool enable = false;
  bool disable = false;
  std::string force_medium;
  bool clear_force = false;
  bool set_audit_fraction = false;
  double audit_fraction = 0.0;
};

int run_route(const AdminSession& session, const RouteChange& change) {
  json body = json::object();
  if (change.enable) body["enabled"] = true;
  if (change.disable) body["enabled"] = false;
  if (!change.force_medium.empty()) body["forced_medium"] = change.force_medium;
  if (change.clear_force) body["forced_medium"] = nullptr;
  if (change.set_audit_fraction) body["audit_fraction"] = change.audit_fraction;
  if (body.empty()) {
    print_error(
        "route: nothing to change: give --enable, --disable, --force-medium, --clear-force or "
        "--audit-fraction");
    return exit_code_of(AdminExit::kUsage);
  }
  AdminReply reply;
  json route;
  if (const int code =
          call_admin_json(session, "PUT", "/admin/routes/" + percent_encode(change.route), reply, route, body.dump());
      code != 0) {
    return code;
  }
  if (session.json) {
    print_body(reply.body);
  } else {
    std::cout << route_line(route) << std::flush;
  }
  return exit_code_of(AdminExit::kOk);
}

struct DecisionsOptions {
  std::string route;
  std::size_t limit = 20;
  bool follow = false;
  double interval_s = 1.0;
};

void print_decisions(const AdminSession& session, const json& decisions) {
  for (const auto& decision : decisions) {
    if (session.json) {
      std::cout << decision.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
    } else {
      std::cout << decision_line(decision);
    }
  }
  std::cout.flush();
}

std::uint64_t cursor_of(const json& page) {
  return page.contains("cursor") && page["cursor"].is_number_unsigned() ? page["cursor"].get<std::uint64_t>() : 0;
}

int run_decisions(const AdminSession& session, const DecisionsOptions& options) {
  const std::string route_query = options.route.empty() ? "" : "&route=" + percent_encode(options.route);
  AdminReply reply;
  json page;
  if (const int code = call_admin_json(
          session, "GET", fmt::format("/admin/decisions?limit={}{}", options.limit, route_query), reply, page);
      code != 0) {
    return code;
  }
  json decisions = page.contains("decisions") && page["decisions"].is_array() ? page["decisions"] : json::array();
  if (!options.follow && session.json) {
    print_body(reply.body);
    return exit_code_of(AdminExit::kOk);
  }
  // The daemon answers newest first; a log reads oldest first, the newest at the bottom.
  std::reverse(decisions.begin(), decisions.end());
  print_decisions(session, decisions);
  if (!options.follow) return exit_code_of(AdminExit::kOk);
  if (!page.contains("cursor")) {
    print_error("--follow: the daemon's GET /admin/decisions has no cursor (a kvrelay from before issue #30)");
    return exit_code_of(AdminExit::kOther);
  }
  std::uint64_t since = cursor_of(page);
  const auto interval = std::chrono::duration<double>(options.interval_s);
  while (true) {
    std::this_thread::sleep_for(interval);
    if (const int code = call_admin_json(session, "GET", fmt::format("/admin/decisions?since={}{}", since, route_query),
                                         reply, page);
        code != 0) {
      return code;
    }
    const auto cursor = cursor_of(page);
    if (cursor < since) {
      // Sequence numbers start again at 1 when the daemon restarts: read its ring from the start.
      print_error(fmt::format("the daemon's decision log restarted (cursor {} after {}); following it from its start",
                              cursor, since));
      since = 0;
      continue;
    }
    if (page.contains("missed") && page["missed"].is_number_unsigned() && page["missed"].get<std::uint64_t>() > 0) {
      print_error(fmt::format("{} decisions left the daemon's ring before they could be read",
                              page["missed"].get<std::uint64_t>()));
    }
    if (page.contains("decisions") && page["decisions"].is_array()) print_decisions(session, page["decisions"]);
    since = cursor;
  }
}

int run_simple_json(const AdminSession& session, std::string_view method, const std::string& target,
                    const std::function<std::string(const json&)>& render) {
  AdminReply reply;
  json body;
  if (const int code = call_admin_json(session, method, target, reply, body); code != 0) return code;
  if (session.json) {
    print_body(reply.body);
  } else {
    std::cout << render(body) << std::flush;
  }
  return exit_code_of(AdminExit::kOk);
}

int run_audit(const AdminSession& session, std::string format) {
  if (session.json) format = "json";
  AdminReply reply;
  if (const int code = call_admin(session, "GET", "/admin/audit/report?format=" + format, reply); code != 0)
    return code;
  print_body(reply.body);
  return exit_code_of(AdminExit::kOk);
}

// --admin, --token-file and --timeout made into a session; nullopt (with the reason printed)
// for a usage error.
std::optional<AdminSession> open_session(const AdminCommonOptions& options) {
  AdminSession session;
  session.json = options.json;
  std::string url = options.admin_url;
  if (url.empty()) {
    const char* from_environment = std::getenv("KVRELAY_ADMIN");
    url = from_environment != nullptr && *from_environment != '\0' ? from_environment : kDefaultAdminUrl;
  }
  auto address = parse_admin_address(url);
  if (!address) {
    print_error(address.error().message);
    return std::nullopt;
  }
  session.connection.address = std::move(address).value();
  std::string token_file = options.token_file;
  if (token_file.empty()) {
    const char* from_environment = std::getenv("KVRELAY_ADMIN_TOKEN_FILE");
    if (from_environment != nullptr) token_file = from_environment;
  }
  if (!token_file.empty()) {
    auto token = read_admin_token(token_file);
    if (!token) {
      print_error(token.error().message);
      return std::nullopt;
    }
    session.connection.token = std::move(token).value();
  }
  if (!(options.timeout_s > 0.0) || options.timeout_s > 3600.0) {
    print_error(fmt::format("--timeout: expected seconds in (0, 3600], got {}", options.timeout_s));
    return std::nullopt;
  }
  session.connection.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(options.timeout_s * 1000.0));
  if (session.connection.timeout.count() == 0) session.connection.timeout = std::chrono::milliseconds(1);
  return session;
}

int run_admin(std::vector<std::string> args) {
  CLI::App cli{
      "The admin API of a running kvrelay daemon (docs/admin-cli.md). Exit codes: 0 ok, 1 other failure, "
      "2 usage, 3 admin API unreachable, 4 unauthorised (401/403), 5 refused by the daemon (4xx)",
      "kvrelay admin"};
  cli.require_subcommand(1);
  cli.fallthrough();
  AdminCommonOptions common;
  cli.add_option("--admin", common.admin_url,
                 fmt::format("The daemon's admin listener, http://HOST:PORT (default: $KVRELAY_ADMIN, else {})",
                             kDefaultAdminUrl));
  cli.add_option("--token-file", common.token_file,
                 "File holding the admin token, sent as Authorization: Bearer (default: $KVRELAY_ADMIN_TOKEN_FILE)");
  cli.add_flag("--json", common.json, "Print the daemon's JSON instead of a table");
  cli.add_option("--timeout", common.timeout_s, "Seconds to wait for the connection and each answer (default 10)");

  std::function<int(const AdminSession&)> action;
  cli.add_subcommand("routes", "Each route: enabled, forced medium, last medium chosen, audit fraction, recent TTFT")
      ->callback([&action] { action = run_routes; });

  RouteChange change;
  auto* route = cli.add_subcommand("route", "Change one route live (PUT /admin/routes/ROUTE)");
  route->add_option("ROUTE", change.route, "The route's id")->required();
  auto* enable = route->add_flag("--enable", change.enable, "Enable the route");
  auto* disable = route->add_flag("--disable", change.disable, "Disable it: its KV media become tokens");
  enable->excludes(disable);
  auto* force = route->add_option("--force-medium", change.force_medium, "Force a medium (tokens, kv_raw, ...)");
  auto* clear = route->add_flag("--clear-force", change.clear_force, "Let the engine choose again");
  force->excludes(clear);
  auto* audit_fraction =
      route->add_option("--audit-fraction", change.audit_fraction, "Share of requests audited, 0..1");
  route->callback(
      [&action, &change] { action = [&change](const AdminSession& session) { return run_route(session, change); }; });

  DecisionsOptions decisions;
  auto* decisions_command =
      cli.add_subcommand("decisions", "Recent decisions, one line each with medium and cost terms; --follow streams");
  decisions_command->add_option("--route", decisions.route, "Only this route's decisions");
  decisions_command->add_option("--limit", decisions.limit, "How many recent decisions to show first (default 20)")
      ->check(CLI::Range(std::size_t{1}, kMaxDecisionLimit));
  decisions_command->add_flag("--follow,-f", decisions.follow, "Keep printing new decisions as they are made");
  decisions_command->add_option("--interval", decisions.interval_s, "Seconds between polls with --follow (default 1)")
      ->check(CLI::Range(0.01, 3600.0));
  decisions_command->callback([&action, &decisions] {
    action = [&decisions](const AdminSession& session) { return run_decisions(session, decisions); };
  });

  cli.add_subcommand("peers", "Peers: state, transport, link RTT and throughput, summaries")->callback([&action] {
    action = [](const AdminSession& session) { return run_simple_json(session, "GET", "/admin/peers", peers_table); };
  });

  std::size_t kv_limit = 10;
  auto* kv =
      cli.add_subcommand("kv", "The KV store: use against its budget, evictions, spills, its most valued entries");
  kv->add_option("--limit", kv_limit, "Entries to list (default 10)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1000}));
  kv->callback([&action, &kv_limit] {
    action = [&kv_limit](const AdminSession& session) {
      // The store's top list needs at least one; --limit 0 shows the figures only.
      const auto limit = std::max<std::size_t>(kv_limit, 1);
      return run_simple_json(session, "GET", fmt::format("/admin/kv?limit={}", limit), [&kv_limit](const json& body) {
        json shown = body;
        if (kv_limit == 0) shown["top"] = json::array();
        return kv_report(shown);
      });
    };
  });

  cli.add_subcommand("reload", "Re-read the daemon's policy file (POST /admin/reload)")->callback([&action] {
    action = [](const AdminSession& session) {
      return run_simple_json(session, "POST", "/admin/reload", reload_report);
    };
  });

  std::string audit_format = "markdown";
  auto* audit = cli.add_subcommand("audit", "The online audit's report: markdown (default), svg or json");
  auto* format = audit->add_option("--format", audit_format, "markdown, svg or json")
                     ->check(CLI::IsMember({"markdown", "svg", "json"}));
  audit->callback([&action, &audit_format] {
    action = [&audit_format](const AdminSession& session) { return run_audit(session, audit_format); };
  });

  std::reverse(args.begin(), args.end());  // CLI11 takes a vector of arguments last first
  try {
    cli.parse(args);
  } catch (const CLI::CallForHelp& help) {
    return cli.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return cli.exit(help);
  } catch (const CLI::ParseError& error) {
    (void)cli.exit(error);
    return exit_code_of(AdminExit::kUsage);
  }
  if (!action) return exit_code_of(AdminExit::kUsage);
  change.set_audit_fraction = audit_fraction->count() > 0;
  if (audit->parsed() && common.json && format->count() > 0 && audit_format != "json") {
    print_error(fmt::format("audit: --json asks for --format json, not --format {}", audit_format));
    return exit_code_of(AdminExit::kUsage);
  }
  const auto session = open_session(common);
  if (!session) return exit_code_of(AdminExit::kUsage);
  return action(*session);
}

}  // namespace

void add_admin_command(CLI::App& app, int& exit_code) {
  auto* admin =
      app.add_subcommand("admin",
                         "The admin API from the command line: routes, route, decisions, peers, kv, reload, audit "
                         "(kvrelay admin --help; docs/admin-cli.md)");
  // Everything after `admin` is parsed by run_admin, --help included.
  admin->prefix_command();
  admin->allow_extras();
  admin->set_help_flag();
  admin->callback([admin, &exit_code] { exit_code = run_admin(admin->remaining()); });
}

}  // namespace kvrelay::cli
