#include "kvrelay/broker/deliveries.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/core/policy.h"

namespace kvrelay::broker {

Delivery summary_delivery(const Treatment& assigned, const SummaryApplied& summary) {
  Delivery delivery;
  delivery.span = KvSpan::kAll;
  delivery.medium = std::string(kSummaryMedium);
  delivery.as_assigned =
      assigned.span == KvSpan::kAll && (assigned.medium.empty() || assigned.medium == kSummaryMedium);
  if (!delivery.as_assigned) {
    delivery.reason = fmt::format("the front proxy summarised A's {} tokens ({})", summary.span_tokens,
                                  summary.source.empty() ? std::string("front_proxy") : summary.source);
  }
  return delivery;
}

void Deliveries::record(const std::string& request_id, Delivery delivery) {
  const std::lock_guard lock(mutex_);
  const auto same =
      std::find_if(pending_.begin(), pending_.end(), [&](const auto& item) { return item.first == request_id; });
  if (same != pending_.end()) {
    same->second = std::move(delivery);
    return;
  }
  if (pending_.size() >= kMaxPending) pending_.pop_front();
  pending_.emplace_back(request_id, std::move(delivery));
}

std::optional<Delivery> Deliveries::take(const std::string& request_id) {
  const std::lock_guard lock(mutex_);
  // Newest first: the request that just ended was looked up recently.
  const auto found =
      std::find_if(pending_.rbegin(), pending_.rend(), [&](const auto& item) { return item.first == request_id; });
  if (found == pending_.rend()) return std::nullopt;
  auto delivery = std::move(found->second);
  pending_.erase(std::next(found).base());
  return delivery;
}

}  // namespace kvrelay::broker
