#include "kvrelay/proxy/runtime_policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <string_view>
#include <vector>

namespace kvrelay::proxy {

RuntimePolicy::RuntimePolicy(std::string path, std::shared_ptr<const Policy> initial, metrics::Registry& registry)
    : path_(std::move(path)),
      current_(std::move(initial)),
      reloads_(registry.counter("kvrelay_config_reloads_total", "Policy reloads by result (ok, rejected)", {"result"})),
      route_updates_(
          registry.counter("kvrelay_admin_route_updates_total", "Live route changes through the admin API", {"route"})),
      last_reload_success_(
          registry
              .gauge("kvrelay_config_last_reload_successful", "1 if the last reload was applied, 0 if it was rejected")
              .get()) {
  last_reload_success_.set(1);
}

Result<std::string> RuntimePolicy::reload() {
  const std::lock_guard lock(write_mutex_);
  auto loaded = load_policy_file(path_);
  if (!loaded) {
    reloads_.with({"rejected"}).inc();
    last_reload_success_.set(0);
    spdlog::error("policy reload rejected; still serving the previous policy:\n{}", loaded.error().message);
    return loaded.error();
  }
  const auto previous = current_.load();
  auto next = std::make_shared<const Policy>(std::move(loaded).value());
  // Settings read at start: say so instead of claiming them applied.
  std::vector<std::string_view> on_restart;
  if (!(next->listen.http == previous->listen.http) || next->listen.admin != previous->listen.admin ||
      next->listen.peer != previous->listen.peer || next->listen.unix_socket != previous->listen.unix_socket) {
    on_restart.emplace_back("listen addresses");
  }
  if (next->node_id != previous->node_id) on_restart.emplace_back("node id");
  if (next->codecs.device != previous->codecs.device || next->codecs.plugin_dirs != previous->codecs.plugin_dirs) {
    on_restart.emplace_back("codecs (plugin_dirs, device)");
  }
  const std::string note = on_restart.empty()
                               ? std::string("applied")
                               : fmt::format("applied; {} take effect on restart", fmt::join(on_restart, " and "));
  current_.store(std::move(next));
  reloads_.with({"ok"}).inc();
  last_reload_success_.set(1);
  spdlog::info("policy reloaded from {}: {}", path_, note);
  return note;
}

Result<RoutePolicy> RuntimePolicy::update_route(const std::string& route_id, const nlohmann::json& changes) {
  if (!changes.is_object()) return fail(ErrorCode::kInvalidArgument, "body must be a JSON object");
  const std::lock_guard lock(write_mutex_);
  auto next = std::make_shared<Policy>(*current_.load());
  auto found = std::find_if(next->routes.begin(), next->routes.end(), [&](const auto& r) { return r.id == route_id; });
  if (found == next->routes.end()) return fail(ErrorCode::kNotFound, fmt::format("no route '{}'", route_id));
  RoutePolicy& route = *found;
  for (const auto& [key, value] : changes.items()) {
    if (key == "enabled") {
      if (!value.is_boolean())
        return fail(ErrorCode::kInvalidArgument, fmt::format("/enabled: expected boolean, got {}", value.dump()));
      route.enabled = value.get<bool>();
    } else if (key == "forced_medium") {
      if (value.is_null()) {
        route.forced_medium.reset();
        continue;
      }
      if (!value.is_string() || !is_known_medium(value.get<std::string>())) {
        return fail(ErrorCode::kInvalidArgument,
                    fmt::format("/forced_medium: expected a medium name or null, got {}", value.dump()));
      }
      const auto medium = value.get<std::string>();
      if (!route.allowed_media.empty() &&
          std::find(route.allowed_media.begin(), route.allowed_media.end(), medium) == route.allowed_media.end()) {
        return fail(ErrorCode::kInvalidArgument,
                    fmt::format("/forced_medium: \"{}\" is not in the route's allowed_media", medium));
      }
      route.forced_medium = medium;
    } else if (key == "audit_fraction") {
      if (!value.is_number() || value.get<double>() < 0.0 || value.get<double>() > 1.0) {
        return fail(ErrorCode::kInvalidArgument,
                    fmt::format("/audit_fraction: expected number 0..1, got {}", value.dump()));
      }
      route.audit_fraction = value.get<double>();
      route.audit.fraction = route.audit_fraction;
    } else {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("/{}: unknown key (allowed here: enabled, forced_medium, audit_fraction)", key));
    }
  }
  RoutePolicy updated = route;
  current_.store(std::move(next));
  route_updates_.with({route_id}).inc();
  spdlog::info("route {} changed live: {}", route_id, changes.dump());
  return updated;
}

nlohmann::json route_to_json(const RoutePolicy& route) {
  nlohmann::json body{{"id", route.id},
                      {"from", route.from_agent},
                      {"to", route.to_agent},
                      {"enabled", route.enabled},
                      {"allowed_media", route.allowed_media},
                      {"forced_medium", route.forced_medium ? nlohmann::json(*route.forced_medium) : nlohmann::json()},
                      {"priority", route.priority},
                      {"audit_fraction", route.audit_fraction},
                      {"hysteresis", route.hysteresis_threshold},
                      {"quality_floor", route.quality_floor},
                      {"push", route.push}};
  if (route.deadline) body["deadline_ms"] = route.deadline->count();
  nlohmann::json treatments = nlohmann::json::array();
  for (const auto& treatment : route.audit.treatments) {
    treatments.push_back({{"name", treatment.name}, {"medium", treatment.medium}, {"span", treatment.span}});
  }
  body["audit"] = {{"fraction", route.audit.fraction},
                   {"treatments", std::move(treatments)},
                   {"trials_file", route.audit.trials_file}};
  return body;
}

}  // namespace kvrelay::proxy
