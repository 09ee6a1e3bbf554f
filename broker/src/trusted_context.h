#pragma once

// What a worker's message (lookup, publish, prefill report) says about its request, as far as
// the KV path may believe it. With a node key (policy signing.node_key_file) kvrelay fields that
// are unsigned or whose signature does not verify are dropped: the message is served as if it
// carried none (no route, the default tenant), and `ignored` says why, for the metric and the
// decision record. Without a node key the fields are taken as they are.

#include <string>
#include <string_view>

#include "kvrelay/broker/request_context.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::broker {

struct TrustedContext {
  RequestContext context;
  std::string ignored;  // "", "unsigned" or "forged"
};

[[nodiscard]] Result<TrustedContext> trusted_request_context(const Policy& policy, std::string_view params_json);

}  // namespace kvrelay::broker
