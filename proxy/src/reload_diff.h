#pragma once

// What a policy reload changes, field by field, and which of those changes the running daemon
// can apply. A field is live when every reader takes it from the current policy snapshot (or the
// decision engine receives it); it needs a restart when something was built from it at start
// (listeners, the store, the codecs, logging). docs/operations.md lists both classes.

#include <string>
#include <vector>

#include "kvrelay/core/policy.h"

namespace kvrelay::proxy {

struct PolicyChanges {
  // JSON pointers into the new file; an added agent, route or peer is named by its own pointer,
  // a removed one by its array's ("/routes").
  std::vector<std::string> live;
  std::vector<std::string> restart_required;
};

[[nodiscard]] PolicyChanges diff_policies(const Policy& before, const Policy& after);

// Sets every restart-only field of `next` back to `running`'s value, so the snapshot readers see
// says what actually runs until the restart.
void keep_restart_fields(const Policy& running, Policy& next);

// Every field of the two routes is equal.
[[nodiscard]] bool same_route(const RoutePolicy& left, const RoutePolicy& right);

}  // namespace kvrelay::proxy
