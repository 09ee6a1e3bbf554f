#pragma once

// The HTTP side of `kvrelay admin` (issue #30, docs/admin-cli.md): one blocking request to the
// daemon's admin listener on a fresh connection, bounded by a timeout, with the admin token as a
// bearer header; and the exit codes that say what failed.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "kvrelay/core/result.h"

namespace kvrelay::cli {

// What `kvrelay admin` exits with (docs/admin-cli.md, "Exit codes").
enum class AdminExit : int {
  kOk = 0,
  kOther = 1,         // the daemon failed (5xx) or answered something unreadable; local I/O
  kUsage = 2,         // bad options, an unreadable token file, a malformed --admin URL
  kUnreachable = 3,   // no HTTP answer: resolve, connect, timeout, connection closed
  kUnauthorised = 4,  // 401 or 403: no token, a wrong token, or a read-only admin API
  kRefused = 5,       // any other 4xx: the daemon's JSON error names what it refused and why
};

[[nodiscard]] constexpr int exit_code_of(AdminExit code) noexcept {
  return static_cast<int>(code);
}

// --admin: http://HOST:PORT with an optional path prefix (a reverse proxy's), no query.
struct AdminAddress {
  std::string host;
  std::string port;
  std::string base_path;  // "" or "/prefix", no trailing slash
  [[nodiscard]] std::string to_string() const { return "http://" + host + ":" + port + base_path; }
};
[[nodiscard]] Result<AdminAddress> parse_admin_address(std::string_view url);

// The token file's first line, surrounding whitespace removed; an empty file is an error.
[[nodiscard]] Result<std::string> read_admin_token(const std::filesystem::path& path);

// Bytes outside RFC 3986's unreserved set as %XX, for a route id in a path or a query.
[[nodiscard]] std::string percent_encode(std::string_view text);

struct AdminConnection {
  AdminAddress address;
  std::string token;  // "" sends no Authorization header
  std::chrono::milliseconds timeout{10'000};
};

struct AdminReply {
  unsigned status = 0;
  std::string body;
  std::string content_type;
};

// One request; an error only when no complete HTTP answer came back (the admin listener is
// unreachable from here, or silent past the timeout). `target` is the path after base_path.
[[nodiscard]] Result<AdminReply> send_admin_request(const AdminConnection& connection, std::string_view method,
                                                    std::string_view target, std::string body = {});

}  // namespace kvrelay::cli
