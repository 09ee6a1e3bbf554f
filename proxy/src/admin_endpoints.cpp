#include "kvrelay/proxy/admin_endpoints.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "kvrelay/audit/calibrate.h"
#include "kvrelay/audit/render.h"
#include "kvrelay/decision/media.h"
#include "kvrelay/proxy/version.h"

namespace kvrelay::proxy {

namespace {

constexpr std::string_view kRoutesPrefix = "/admin/routes/";

// "format" from a query string such as "?format=markdown"; json when absent.
std::string_view requested_format(std::string_view target) {
  const auto query = target.find('?');
  if (query == std::string_view::npos) return "json";
  constexpr std::string_view kKey = "format=";
  const auto key = target.find(kKey, query);
  if (key == std::string_view::npos) return "json";
  const auto value = target.substr(key + kKey.size());
  return value.substr(0, value.find('&'));
}

HttpResponse audit_report(const std::shared_ptr<OnlineAudit>& audit, const HttpRequest& request) {
  const auto format = requested_format(request.target());
  audit::AnalysisOptions options;
  options.bootstrap.resamples = 1000;
  if (format == "json") {
    const auto body = audit ? audit->report(options) : nlohmann::json{{"trials", 0}};
    return make_json_response(http::status::ok, body.dump(), request);
  }
  if (format != "markdown" && format != "svg") {
    return make_json_error(http::status::bad_request, "invalid_argument",
                           fmt::format("format '{}' is not one of json, markdown, svg", std::string(format)),
                           request.version(), request.keep_alive());
  }
  const auto trials = audit ? audit->snapshot() : audit::TrialSet{};
  auto report = audit::analyze(trials, options);
  if (!report) {
    return make_json_error(http::status::conflict, "not_analysable", report.error().message, request.version(),
                           request.keep_alive());
  }
  if (format == "markdown") {
    return make_text_response(http::status::ok, audit::render_markdown(report.value()), "text/markdown; charset=utf-8",
                              request);
  }
  return make_text_response(http::status::ok, audit::render_svg(report.value(), trials, options), "image/svg+xml",
                            request);
}

HttpResponse error_for(const Error& error, const HttpRequest& request) {
  const auto status = error.code == ErrorCode::kNotFound ? http::status::not_found : http::status::bad_request;
  return make_json_error(status, std::string(error_code_name(error.code)), error.message, request.version(),
                         request.keep_alive());
}

// A forced plugin medium must name a codec this daemon loaded: otherwise every lookup on the
// route would fall back to tokens while the route claims the plugin.
Status check_plugin_loaded(const codec::CodecRegistry* codecs, const nlohmann::json& changes) {
  const auto forced = changes.is_object() ? changes.find("forced_medium") : changes.end();
  if (!changes.is_object() || forced == changes.end() || !forced->is_string()) return ok();
  const auto codec = decision::plugin_codec_of(forced->get_ref<const std::string&>());
  if (!codec || (codecs != nullptr && codec::resolve_codec(*codecs, *codec))) return ok();
  return fail(ErrorCode::kInvalidArgument,
              fmt::format("/forced_medium: codec \"{}\" is not loaded here (GET /admin/codecs)", *codec));
}

nlohmann::json codecs_to_json(const codec::CodecRegistry& registry,
                              const std::vector<codec::PluginLoadFailure>& failures) {
  nlohmann::json codecs = nlohmann::json::array();
  for (const auto& codec : registry.codecs()) {
    codecs.push_back({{"name", codec->name()},
                      {"id", codec->id()},
                      {"flags", codec->flag_names()},
                      {"lossless", codec->lossless()},
                      {"origin", codec->origin()},
                      {"device", codec->device()}});
  }
  nlohmann::json refused = nlohmann::json::array();
  for (const auto& failure : failures)
    refused.push_back({{"path", failure.path.string()}, {"error", failure.error.to_string()}});
  return {{"codecs", codecs}, {"refused_plugins", refused}};
}

// GET /admin/routes' recent time to first token per route. The front proxy measures every
// request's, but files it per request only for audited ones (their outcome records): the median
// of a route's last kRecentTtftWindow audited outcomes. Beside it, the receiving agent's engine's
// own mean over its last probe interval (/admin/upstreams), which covers all its requests.
constexpr std::size_t kRecentTtftWindow = 64;

std::map<std::string, std::vector<double>, std::less<>> recent_audited_ttft(const OnlineAudit* audit) {
  std::map<std::string, std::vector<double>, std::less<>> by_route;
  if (audit == nullptr) return by_route;
  const auto trials = audit->snapshot();
  for (auto it = trials.trials.rbegin(); it != trials.trials.rend(); ++it) {
    const bool answered = !it->status || (*it->status >= 200 && *it->status < 300);
    auto& window = by_route[it->route];
    if (answered && window.size() < kRecentTtftWindow) window.push_back(it->ttft_ms);
  }
  return by_route;
}

nlohmann::json median_or_null(std::vector<double> values) {
  if (values.empty()) return nullptr;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  if (values.size() % 2 == 1) return *middle;
  const double below = *std::max_element(values.begin(), middle);
  return (below + *middle) / 2.0;
}

nlohmann::json route_ttft_json(const RoutePolicy& route,
                               const std::map<std::string, std::vector<double>, std::less<>>& audited,
                               const nlohmann::json& agents) {
  const auto window = audited.find(route.id);
  const std::vector<double> none;
  const auto& samples = window == audited.end() ? none : window->second;
  nlohmann::json engine_ms = nullptr;
  if (const auto agent = agents.find(route.to_agent); agent != agents.end() && agent->is_object()) {
    const auto seconds = agent->find("time_to_first_token_s");
    if (seconds != agent->end() && seconds->is_number()) engine_ms = seconds->get<double>() * 1000.0;
  }
  return {{"audited_median_ms", median_or_null(samples)},
          {"audited_samples", samples.size()},
          {"receiver_engine_mean_ms", std::move(engine_ms)}};
}

}  // namespace

std::vector<AdminEndpoint> build_admin_endpoints(const AdminContext& context) {
  const auto policy = context.policy;
  const auto registry = context.registry;
  const auto is_ready = context.is_ready;
  const auto codecs = context.codecs;
  const auto prober = context.upstream_prober;
  // Fixed after start-up (plugins load once), so rendered once.
  const auto codecs_body =
      codecs ? codecs_to_json(*codecs, context.codec_load_failures).dump() : std::string(R"({"codecs":[]})");
  const auto online_audit = context.audit;
  std::vector<AdminEndpoint> endpoints{
      {http::verb::get, Access::kPublic, "/healthz", "Liveness: 200 while the process serves requests",
       [](const HttpRequest& request) { return make_json_response(http::status::ok, R"({"status":"ok"})", request); }},
      {http::verb::get, Access::kPublic, "/readyz", "Readiness: 200 once listening and not draining, else 503",
       [is_ready](const HttpRequest& request) {
         const bool ready = is_ready();
         return make_json_response(ready ? http::status::ok : http::status::service_unavailable,
                                   ready ? R"({"status":"ready"})" : R"({"status":"not_ready"})", request);
       }},
      {http::verb::get, Access::kRead, "/metrics", "Prometheus metrics of every component (text format 0.0.4)",
       [registry, before = context.before_metrics](const HttpRequest& request) {
         if (before) before();
         return make_text_response(http::status::ok, registry->render(), "text/plain; version=0.0.4; charset=utf-8",
                                   request);
       }},
      {http::verb::get, Access::kRead, "/version", "Build version and the node this daemon serves",
       [policy](const HttpRequest& request) {
         const nlohmann::json body{{"version", kVersion}, {"node", policy->current()->node_id}};
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      {http::verb::get, Access::kRead, "/admin/routes",
       "Routes as currently served (after live changes), each with its recent time to first token",
       [policy, online_audit, prober](const HttpRequest& request) {
         const auto audited = recent_audited_ttft(online_audit.get());
         const auto upstreams = prober ? prober->snapshot_json() : nlohmann::json::object();
         const auto agents = upstreams.value("agents", nlohmann::json::object());
         nlohmann::json routes = nlohmann::json::array();
         for (const auto& route : policy->current()->routes) {
           auto body = route_to_json(route);
           body["recent_ttft"] = route_ttft_json(route, audited, agents);
           routes.push_back(std::move(body));
         }
         return make_json_response(http::status::ok, nlohmann::json{{"routes", routes}}.dump(), request);
       }},
      {http::verb::put, Access::kMutate, "/admin/routes/*",
       "Change a route live: {\"enabled\": bool, \"forced_medium\": medium|null, \"audit_fraction\": 0..1}",
       [policy, codecs](const HttpRequest& request) {
         const auto route_id = std::string(request.target().substr(kRoutesPrefix.size()));
         const auto changes = nlohmann::json::parse(request.body(), nullptr, false);
         if (changes.is_discarded()) {
           return make_json_error(http::status::bad_request, "invalid_argument", "body is not valid JSON",
                                  request.version(), request.keep_alive());
         }
         if (auto loaded = check_plugin_loaded(codecs.get(), changes); !loaded)
           return error_for(loaded.error(), request);
         auto updated = policy->update_route(route_id.substr(0, route_id.find('?')), changes);
         if (!updated) return error_for(updated.error(), request);
         return make_json_response(http::status::ok, route_to_json(updated.value()).dump(), request);
       }},
      {http::verb::get, Access::kRead, "/admin/codecs",
       "Codecs this daemon can use (built-in and plugins) and plugins it refused",
       [codecs_body](const HttpRequest& request) {
         return make_json_response(http::status::ok, codecs_body, request);
       }},
      {http::verb::get, Access::kRead, "/admin/upstreams",
       "Load last read from each agent's engine metrics page (limits.probe_interval_ms)",
       [prober](const HttpRequest& request) {
         const auto body = prober ? prober->snapshot_json() : nlohmann::json{{"agents", nlohmann::json::object()}};
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      {http::verb::get, Access::kRead, "/admin/audit/report",
       "Online audit: effects of each treatment vs T0 with CIs (?format=json|markdown|svg)",
       [online_audit](const HttpRequest& request) { return audit_report(online_audit, request); }},
      {http::verb::get, Access::kRead, "/admin/audit/calibration",
       "Cost-model parameters from the online audit's trials, as a policy fragment to review, and the live "
       "calibration's refits (routes[].audit.calibrate \"live\"; docs/audit.md)",
       [online_audit, live = context.live_calibration](const HttpRequest& request) {
         const auto trials = online_audit ? online_audit->snapshot() : audit::TrialSet{};
         auto body = audit::calibrate(trials, audit::CalibrationOptions{});
         body["live"] = live ? live() : nlohmann::json();
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      {http::verb::post, Access::kMutate, "/admin/reload",
       "Re-read the policy file; a bad policy is rejected and the old one keeps serving",
       [policy](const HttpRequest& request) {
         auto reloaded = policy->reload();
         if (!reloaded) {
           return make_json_error(http::status::unprocessable_entity, "policy_rejected", reloaded.error().message,
                                  request.version(), request.keep_alive());
         }
         return make_json_response(http::status::ok, reloaded.value().to_json().dump(), request);
       }},
  };
  endpoints.insert(endpoints.end(), context.extra_endpoints.begin(), context.extra_endpoints.end());
  return endpoints;
}

}  // namespace kvrelay::proxy
