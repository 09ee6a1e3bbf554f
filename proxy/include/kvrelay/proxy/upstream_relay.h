#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "kvrelay/core/policy.h"
#include "kvrelay/proxy/streaming_responder.h"
#include "kvrelay/proxy/upstream_pool.h"

namespace kvrelay::proxy {

struct RelayOutcome {
  unsigned status = 0;           // upstream status, or the status kvrelay answered with
  bool upstream_failed = false;  // connect/write/read error or timeout before a response
  std::string error_kind;        // "connect", "timeout", "read", "write", "client" when failed
  std::chrono::steady_clock::duration time_to_first_byte{};       // response header
  std::chrono::steady_clock::duration time_to_first_body_byte{};  // first body byte (SSE: first token)
  std::chrono::steady_clock::duration total{};
  std::uint64_t response_bytes = 0;
  std::string body_tail;  // last bytes of the body, when the relay was asked to keep them
};

// Sends `request` to `upstream` (on a pooled keep-alive connection when `pool` has one, else a new
// one that returns to the pool afterwards) and streams the response to the client as
// it arrives: headers first, then each body read as it comes (SSE events are not buffered).
// Upstream failures before any byte was sent to the client become a 502/504 JSON error.
// With keep_tail_bytes > 0 the outcome carries the body's last bytes (worker stats).
[[nodiscard]] std::shared_ptr<StreamingResponder> make_upstream_relay(
    std::shared_ptr<UpstreamPool> pool, HttpUrl upstream, HttpRequest request, bool client_keep_alive,
    std::chrono::milliseconds timeout, std::function<void(const RelayOutcome&)> on_finished,
    std::size_t keep_tail_bytes = 0);

}  // namespace kvrelay::proxy
