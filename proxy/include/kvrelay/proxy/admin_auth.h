#pragma once

// Who may call an admin endpoint: the bearer token of the policy's admin section
// (docs/security.md). The token is compared in constant time and never logged or
// echoed; an admin change is logged under a label derived from it.

#include <string>
#include <string_view>

#include "kvrelay/core/policy.h"
#include "kvrelay/proxy/http_types.h"

namespace kvrelay::proxy {

// Each endpoint's class, declared in its table row. kPublic: health probes, never a token.
// kRead: a token only with admin.require_token_for_reads. kMutate: always a token, and 403
// when none is configured (the admin API is then read-only).
enum class Access { kPublic, kRead, kMutate };

[[nodiscard]] std::string_view access_name(Access access) noexcept;

struct AdminAuthorization {
  bool allowed = false;
  // Who asked, for the log: "admin-token sha256:1a2b3c4d" (the configured token), "no
  // credential", "a wrong bearer token", or "unauthenticated" for an open endpoint.
  std::string credential;
  HttpResponse refusal;  // the 401 or 403 JSON error when not allowed
};

// Checks `Authorization: Bearer <token>` against `admin` for an endpoint of class `access`.
[[nodiscard]] AdminAuthorization authorize_admin(const HttpRequest& request, Access access, const AdminPolicy& admin);

// "admin-token sha256:" and the first 8 hex digits of SHA-256(token): names a token in logs
// without revealing it.
[[nodiscard]] std::string admin_token_label(std::string_view token);

// Equal secrets, in time independent of where they differ and of their lengths: compares
// SHA-256 digests of both with CRYPTO_memcmp.
[[nodiscard]] bool same_secret(std::string_view presented, std::string_view expected) noexcept;

}  // namespace kvrelay::proxy
