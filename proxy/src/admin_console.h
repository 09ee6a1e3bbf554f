#pragma once

// The web console (issue #30): GET /admin/ui on the admin listener, one self-contained page that
// uses only the admin API the `kvrelay admin` CLI uses. docs/console.md describes it.

#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/proxy/admin_router.h"

namespace kvrelay::proxy {

// The console's rows of the admin endpoint table.
[[nodiscard]] std::vector<AdminEndpoint> console_endpoints();

// The Content-Security-Policy the page is served with: scripts and styles only by the SHA-256 of
// each inline <script> and <style> block of `page`, fetches to the admin listener itself, images
// only as data: URLs (the audit plot), no frames, forms or base URL.
[[nodiscard]] std::string console_content_security_policy(std::string_view page);

// The embedded page (proxy/console/console.html, built into the binary).
[[nodiscard]] std::string_view console_page();

}  // namespace kvrelay::proxy
