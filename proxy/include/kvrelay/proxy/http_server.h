#pragma once

// Beast HTTP/1.1 server: owns sockets, deadlines, parser limits and the bounded per-connection
// response queue; everything it answers comes from a Dispatcher (a pure function for admin
// endpoints, or a StreamingResponder for proxied requests).

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/proxy/admin_router.h"
#include "kvrelay/proxy/streaming_responder.h"

namespace kvrelay::proxy {

struct HttpServerLimits {
  std::uint32_t max_header_bytes = 16 * 1024;
  std::uint64_t max_body_bytes = 16ULL * 1024 * 1024;
  std::chrono::milliseconds read_timeout{30'000};
  std::chrono::milliseconds idle_timeout{60'000};
  std::uint32_t max_connections = 1024;
  std::uint32_t max_queued_responses = 64;

  [[nodiscard]] static HttpServerLimits from_policy(const LimitsPolicy& limits);
};

class HttpServer {
 public:
  HttpServer(boost::asio::io_context& io, HttpServerLimits limits, Dispatcher dispatcher);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts accepting. Port 0 picks an ephemeral port; see local_endpoint().
  [[nodiscard]] Status listen(const HostPort& address);
  [[nodiscard]] boost::asio::ip::tcp::endpoint local_endpoint() const;

  // Stops accepting new connections.
  void stop_accepting();
  // Stops accepting and closes connections between requests; a request already being read or
  // answered completes and its connection closes after the response.
  void drain();

  [[nodiscard]] std::uint64_t active_connections() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kvrelay::proxy
