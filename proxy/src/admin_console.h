#pragma once

// The web console (issue #30): GET /admin/ui on the admin listener, one self-contained page that
// uses only the admin API the `kvrelay admin` CLI uses. docs/console.md describes it.

#include <vector>

#include "kvrelay/proxy/admin_router.h"

namespace kvrelay::proxy {

// The console's rows of the admin endpoint table.
[[nodiscard]] std::vector<AdminEndpoint> console_endpoints();

}  // namespace kvrelay::proxy
