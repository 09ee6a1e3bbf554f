#include "kvrelay/proxy/runtime_policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "kvrelay/decision/engine_from_policy.h"

#include "reload_diff.h"

namespace kvrelay::proxy {

namespace {

// Applies {"enabled", "forced_medium", "audit_fraction"} to `route`; errors name the key's pointer.
Status apply_route_changes(RoutePolicy& route, const nlohmann::json& changes) {
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
  return ok();
}

bool engine_rebuilt_by(const Policy& before, const Policy& after) {
  return decision::engine_topology(decision::engine_view(before)) !=
         decision::engine_topology(decision::engine_view(after));
}

}  // namespace

std::string ReloadReport::summary() const {
  std::string text = "applied";
  if (!restart_required.empty()) text += fmt::format("; restart needed for {}", fmt::join(restart_required, ", "));
  if (!overrides_replaced.empty()) {
    text += fmt::format("; live changes of route {} replaced by the file", fmt::join(overrides_replaced, ", "));
  }
  if (!engine.error.empty()) {
    text += "; no decision engine: " + engine.error;
  } else if (engine.rebuilt) {
    text += "; decision engine rebuilt (learned estimates reset)";
  }
  return text;
}

nlohmann::json ReloadReport::to_json() const {
  nlohmann::json body{{"applied", true},
                      {"status", summary()},
                      {"live", live},
                      {"restart_required", restart_required},
                      {"live_route_overrides", {{"kept", overrides_kept}, {"replaced", overrides_replaced}}},
                      {"engine", !engine.error.empty() ? "unavailable" : (engine.rebuilt ? "rebuilt" : "kept")}};
  if (!engine.error.empty()) {
    body["engine_error"] = engine.error;
  } else if (engine.rebuilt) {
    body["engine_note"] =
        "agents, routes, peers or plugin media changed: learned estimates (link throughput, "
        "prefill fit, codec ratios, loads, measured handoffs) were reset";
  }
  return body;
}

RuntimePolicy::RuntimePolicy(std::string path, std::shared_ptr<const Policy> initial, metrics::Registry& registry)
    : path_(std::move(path)),
      current_(initial),
      file_policy_(std::move(initial)),
      reloads_(registry.counter("kvrelay_config_reloads_total", "Policy reloads by result (ok, rejected)", {"result"})),
      route_updates_(
          registry.counter("kvrelay_admin_route_updates_total", "Live route changes through the admin API", {"route"})),
      last_reload_success_(
          registry
              .gauge("kvrelay_config_last_reload_successful", "1 if the last reload was applied, 0 if it was rejected")
              .get()) {
  last_reload_success_.set(1);
}

Result<ReloadReport> RuntimePolicy::reload() {
  const std::lock_guard lock(write_mutex_);
  const auto reject = [&](const Error& error) {
    reloads_.with({"rejected"}).inc();
    last_reload_success_.set(0);
    spdlog::error("policy reload rejected; still serving the previous policy:\n{}", error.message);
    return error;
  };
  auto loaded = load_policy_file(path_);
  if (!loaded) return reject(loaded.error());
  Policy file = std::move(loaded).value();
  // The file as written, restart-only fields included: the next start would be held to it.
  if (reload_check_) {
    if (auto admitted = reload_check_(file); !admitted) return reject(admitted.error());
  }
  ReloadReport report;
  {
    PolicyChanges changes = diff_policies(*file_policy_, file);
    report.live = std::move(changes.live);
    report.restart_required = std::move(changes.restart_required);
  }
  keep_restart_fields(*file_policy_, file);
  auto next = std::make_shared<Policy>(file);
  // Live route changes outlast a reload that leaves their route as it was in the file.
  for (auto it = route_overrides_.begin(); it != route_overrides_.end();) {
    const RoutePolicy* before = file_policy_->find_route(it->first);
    const auto after = std::find_if(next->routes.begin(), next->routes.end(),
                                    [&](const RoutePolicy& route) { return route.id == it->first; });
    if (before != nullptr && after != next->routes.end() && same_route(*before, *after) &&
        apply_route_changes(*after, it->second)) {
      report.overrides_kept.push_back(it->first);
      ++it;
    } else {
      report.overrides_replaced.push_back(it->first);
      it = route_overrides_.erase(it);
    }
  }
  const auto previous = current_.load();
  file_policy_ = std::make_shared<const Policy>(std::move(file));
  const std::shared_ptr<const Policy> serving = std::move(next);
  current_.store(serving);
  // Without an engine to ask (no KV path), what the topology says is what one would do.
  report.engine =
      engine_observer_ ? engine_observer_(*serving) : broker::EngineUpdate{engine_rebuilt_by(*previous, *serving), {}};
  reloads_.with({"ok"}).inc();
  last_reload_success_.set(1);
  spdlog::info("policy reloaded from {}: {}", path_, report.summary());
  return report;
}

void RuntimePolicy::set_engine_observer(EngineObserver observer) {
  const std::lock_guard lock(write_mutex_);
  engine_observer_ = std::move(observer);
}

void RuntimePolicy::set_reload_check(ReloadCheck check) {
  const std::lock_guard lock(write_mutex_);
  reload_check_ = std::move(check);
}

Result<RoutePolicy> RuntimePolicy::update_route(const std::string& route_id, const nlohmann::json& changes) {
  if (!changes.is_object()) return fail(ErrorCode::kInvalidArgument, "body must be a JSON object");
  const std::lock_guard lock(write_mutex_);
  auto next = std::make_shared<Policy>(*current_.load());
  auto found = std::find_if(next->routes.begin(), next->routes.end(), [&](const auto& r) { return r.id == route_id; });
  if (found == next->routes.end()) return fail(ErrorCode::kNotFound, fmt::format("no route '{}'", route_id));
  KVRELAY_TRY(apply_route_changes(*found, changes));
  RoutePolicy updated = *found;
  auto& merged = route_overrides_[route_id];
  for (const auto& [key, value] : changes.items())
    merged[key] = value;
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
    treatments.push_back({{"name", treatment.name}, {"medium", treatment.medium}, {"span", span_name(treatment.span)}});
  }
  body["audit"] = {{"fraction", route.audit.fraction},
                   {"treatments", std::move(treatments)},
                   {"trials_file", route.audit.trials_file}};
  const auto& summary = route.summary;
  body["summary"] = {
      {"summariser", summary.summariser ? nlohmann::json(summary.summariser->to_string()) : nlohmann::json()},
      {"max_tokens", summary.max_tokens},
      {"template", summary.prompt_template},
      {"instruction", summary.instruction},
      {"timeout_ms", summary.timeout.count()}};
  if (!summary.model.empty()) body["summary"]["model"] = summary.model;
  return body;
}

}  // namespace kvrelay::proxy
