#pragma once

// The admin token test daemons start with, and requests that carry it: mutating admin
// endpoints need a bearer token (docs/security.md).

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "support/http_client.h"
#include "support/test_paths.h"

namespace kvrelay::test {

inline constexpr const char* kTestAdminToken = "kvrelay-test-admin-token-4f1c9a07d2";

// `policy` with the test token in a file under `dir`, unless it has an "admin" section of its
// own (an empty one configures no token: the admin API is read-only).
inline nlohmann::json with_test_admin_token(nlohmann::json policy, const std::filesystem::path& dir) {
  if (policy.is_object() && !policy.contains("admin")) {
    write_file(dir / "admin.token", std::string(kTestAdminToken) + "\n");
    policy["admin"] = {{"token_file", (dir / "admin.token").string()}};
  }
  return policy;
}

inline std::map<std::string, std::string> admin_token_headers(const std::string& token = kTestAdminToken) {
  return {{"Authorization", "Bearer " + token}};
}

// One request to a test daemon's admin API with the test token.
inline HttpResult admin_request(std::uint16_t port, const std::string& method, const std::string& target,
                                const std::string& body = {},
                                std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return http_request(port, method, target, body, admin_token_headers(), timeout);
}

}  // namespace kvrelay::test
