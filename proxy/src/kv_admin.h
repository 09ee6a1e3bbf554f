#pragma once

// Admin rows of the KV path: GET /admin/decisions?limit=N and GET /admin/peers.

#include <memory>
#include <vector>

#include "kvrelay/broker/kv_path.h"
#include "kvrelay/proxy/admin_router.h"

namespace kvrelay::proxy {

inline constexpr std::size_t kDefaultDecisionLimit = 50;

[[nodiscard]] std::vector<AdminEndpoint> kv_admin_endpoints(std::shared_ptr<broker::KvPath> path);

}  // namespace kvrelay::proxy
