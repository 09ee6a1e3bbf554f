#include "kvrelay/proxy/admin_auth.h"

#include <boost/beast/core/string.hpp>
#include <fmt/format.h>

#include <array>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <optional>

namespace kvrelay::proxy {

namespace {

using Sha256 = std::array<unsigned char, SHA256_DIGEST_LENGTH>;

Sha256 sha256_of(std::string_view text) noexcept {
  Sha256 digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

// The token of "Authorization: Bearer <token>" (scheme case-insensitive, RFC 6750); nullopt
// without one.
std::optional<std::string_view> bearer_token(const HttpRequest& request) {
  const auto found = request.find(http::field::authorization);
  if (found == request.end()) return std::nullopt;
  std::string_view value(found->value().data(), found->value().size());
  constexpr std::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() || !boost::beast::iequals(value.substr(0, kScheme.size()), kScheme)) {
    return std::nullopt;
  }
  value.remove_prefix(kScheme.size());
  while (!value.empty() && value.front() == ' ')
    value.remove_prefix(1);
  while (!value.empty() && value.back() == ' ')
    value.remove_suffix(1);
  return value;
}

// What a refused request presented: it names the request in the log and picks the challenge.
enum class Presented { kNothing, kWrongToken };

AdminAuthorization refuse(const HttpRequest& request, http::status status, std::string_view type,
                          std::string_view message, Presented presented) {
  AdminAuthorization result;
  result.credential = presented == Presented::kWrongToken ? "a wrong bearer token" : "no credential";
  result.refusal = make_json_error(status, type, message, request.version(), request.keep_alive());
  if (status == http::status::unauthorized) {
    // RFC 6750 section 3: the challenge, with invalid_token when a token was sent and is wrong.
    result.refusal.set(http::field::www_authenticate, presented == Presented::kWrongToken
                                                          ? R"(Bearer realm="kvrelay-admin", error="invalid_token")"
                                                          : R"(Bearer realm="kvrelay-admin")");
  }
  return result;
}

}  // namespace

std::string_view access_name(Access access) noexcept {
  switch (access) {
    case Access::kPublic:
      return "public";
    case Access::kRead:
      return "read";
    case Access::kMutate:
      return "mutate";
  }
  return "mutate";
}

bool same_secret(std::string_view presented, std::string_view expected) noexcept {
  const auto left = sha256_of(presented);
  const auto right = sha256_of(expected);
  return CRYPTO_memcmp(left.data(), right.data(), left.size()) == 0;
}

std::string admin_token_label(std::string_view token) {
  const auto digest = sha256_of(token);
  return fmt::format("admin-token sha256:{:02x}{:02x}{:02x}{:02x}", digest[0], digest[1], digest[2], digest[3]);
}

AdminAuthorization authorize_admin(const HttpRequest& request, Access access, const AdminPolicy& admin) {
  const bool configured = !admin.token.empty();
  const bool needs_token =
      access == Access::kMutate || (access == Access::kRead && configured && admin.require_token_for_reads);
  if (!needs_token) return AdminAuthorization{true, "unauthenticated", {}};
  if (!configured) {
    return refuse(request, http::status::forbidden, "admin_read_only",
                  "the admin API is read-only: no admin token is configured (/admin/token_file)", Presented::kNothing);
  }
  const auto presented = bearer_token(request);
  if (!presented) {
    return refuse(request, http::status::unauthorized, "unauthorized",
                  "this endpoint needs the admin token: send Authorization: Bearer <token>", Presented::kNothing);
  }
  if (!same_secret(*presented, admin.token)) {
    return refuse(request, http::status::unauthorized, "unauthorized", "the bearer token is not the admin token",
                  Presented::kWrongToken);
  }
  return AdminAuthorization{true, admin_token_label(admin.token), {}};
}

}  // namespace kvrelay::proxy
