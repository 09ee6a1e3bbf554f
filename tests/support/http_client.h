#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace kvrelay::test {

struct HttpResult {
  int status = 0;  // 0: no response (connection failed or closed early)
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string error;
};

// One blocking HTTP/1.1 request on a new connection to 127.0.0.1:port.
[[nodiscard]] HttpResult http_request(std::uint16_t port, const std::string& method, const std::string& target,
                                      const std::string& body = {},
                                      const std::map<std::string, std::string>& headers = {},
                                      std::chrono::milliseconds timeout = std::chrono::seconds(10));

// Sends raw bytes and reads until the peer closes or `timeout`; returns what came back.
[[nodiscard]] std::string raw_exchange(std::uint16_t port, const std::string& bytes,
                                       std::chrono::milliseconds timeout = std::chrono::seconds(5));

}  // namespace kvrelay::test
