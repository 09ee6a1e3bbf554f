#pragma once

// Admin rows of the KV path: GET /admin/decisions?limit=N&route=ID&since=SEQ (since: only the
// decisions after SEQ, oldest first, for `kvrelay admin decisions --follow`) and
// GET /admin/decisions/last (each route's newest decision), GET /admin/peers, the store's
// GET /admin/kv?limit=N (budget, use, evictions, the entries it values most) and DELETE /admin/kv,
// GET /admin/kv/sample?key=HEX&model=HEX (one entry's raw KV, for `kvrelay codec eval`), and
// GET /admin/state?limit=N (the node's state as one document: agents, memory, links, peers).

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <vector>

#include "kvrelay/broker/kv_path.h"
#include "kvrelay/broker/link_queues.h"
#include "kvrelay/proxy/admin_router.h"

namespace kvrelay::proxy {

inline constexpr std::size_t kDefaultDecisionLimit = 50;
inline constexpr std::size_t kDefaultKvListLimit = 20;
inline constexpr std::size_t kMaxKvListLimit = 1000;
// GET /admin/kv/sample copies the entry into its response: larger entries are refused (413).
inline constexpr std::uint64_t kMaxKvSampleBytes = std::uint64_t{1} << 30;

inline constexpr std::size_t kDefaultStateEvents = 64;
inline constexpr std::size_t kMaxStateEvents = 1024;  // the link queues' event ring

// `store`: the store the KV path serves from (the daemon's one); `queues`: the link scheduler
// (null with scheduler.mode "off").
// `agents`: each agent's load as the upstream prober last read it (GET /admin/upstreams' body).
[[nodiscard]] std::vector<AdminEndpoint> kv_admin_endpoints(std::shared_ptr<broker::KvPath> path,
                                                            std::shared_ptr<kv_store::EntryStore> store,
                                                            std::shared_ptr<broker::LinkQueues> queues,
                                                            std::function<nlohmann::json()> agents = {});

// GET /admin/kv's body: the store's figures and its `limit` most valued entries.
[[nodiscard]] nlohmann::json kv_store_json(kv_store::EntryStore& store, std::size_t limit);

}  // namespace kvrelay::proxy
