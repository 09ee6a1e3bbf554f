#include "kvrelay/broker/decision_log.h"

#include <algorithm>

namespace kvrelay::broker {

void DecisionLog::record(nlohmann::json decision) {
  // Every caller records an object; anything else is kept as a value so that seq can be stamped.
  if (!decision.is_object()) decision = nlohmann::json{{"record", std::move(decision)}};
  std::lock_guard lock(mutex_);
  decision["seq"] = ++last_seq_;
  remember_route_locked(decision);
  records_.push_back(std::move(decision));
  while (records_.size() > capacity_)
    records_.pop_front();
}

void DecisionLog::remember_route_locked(const nlohmann::json& decision) {
  const auto route = decision.find("route");
  const auto medium = decision.find("medium");
  if (route == decision.end() || !route->is_string() || medium == decision.end() || !medium->is_string()) return;
  nlohmann::json last{{"seq", last_seq_}, {"medium", *medium}};
  for (const char* field : {"kind", "source", "outcome", "time_unix_ms"}) {
    if (const auto it = decision.find(field); it != decision.end()) last[field] = *it;
  }
  const auto& route_id = route->get_ref<const std::string&>();
  if (last_by_route_.size() >= kMaxRoutesTracked && !last_by_route_.contains(route_id)) {
    const auto oldest =
        std::min_element(last_by_route_.begin(), last_by_route_.end(), [](const auto& a, const auto& b) {
          return a.second.value("seq", std::uint64_t{0}) < b.second.value("seq", std::uint64_t{0});
        });
    last_by_route_.erase(oldest);
  }
  last_by_route_[route_id] = std::move(last);
}

nlohmann::json DecisionLog::recent(std::size_t limit) const {
  nlohmann::json out = nlohmann::json::array();
  std::lock_guard lock(mutex_);
  for (auto it = records_.rbegin(); it != records_.rend() && out.size() < limit; ++it)
    out.push_back(*it);
  return out;
}

namespace {

bool decision_on_route(const nlohmann::json& decision, const std::string& route) {
  if (route.empty()) return true;
  const auto it = decision.find("route");
  return it != decision.end() && it->is_string() && it->get_ref<const std::string&>() == route;
}

}  // namespace

DecisionLog::Page DecisionLog::query(const Query& query) const {
  Page page;
  const std::size_t limit = std::max<std::size_t>(query.limit, 1);
  std::lock_guard lock(mutex_);
  page.cursor = last_seq_;
  if (!query.since) {
    for (auto it = records_.rbegin(); it != records_.rend() && page.decisions.size() < limit; ++it) {
      if (decision_on_route(*it, query.route)) page.decisions.push_back(*it);
    }
    return page;
  }
  const std::uint64_t since = *query.since;
  // records_[i] holds seq first_seq + i.
  const std::uint64_t first_seq = last_seq_ - records_.size() + 1;
  if (since + 1 < first_seq) page.missed = first_seq - since - 1;
  const std::uint64_t start = since >= first_seq ? since - first_seq + 1 : 0;
  for (auto index = static_cast<std::size_t>(std::min<std::uint64_t>(start, records_.size())); index < records_.size();
       ++index) {
    const auto& decision = records_[index];
    if (!decision_on_route(decision, query.route)) continue;
    if (page.decisions.size() == limit) {
      // Cut short: the next poll resumes after the last decision returned.
      page.cursor = page.decisions.back().value("seq", since);
      break;
    }
    page.decisions.push_back(decision);
  }
  return page;
}

nlohmann::json DecisionLog::last_by_route() const {
  nlohmann::json out = nlohmann::json::object();
  std::lock_guard lock(mutex_);
  for (const auto& [route, last] : last_by_route_)
    out[route] = last;
  return out;
}

std::uint64_t DecisionLog::last_seq() const {
  std::lock_guard lock(mutex_);
  return last_seq_;
}

}  // namespace kvrelay::broker
