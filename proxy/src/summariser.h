#pragma once

// The summary medium's network side (issue #28, docs/summary.md): one asynchronous request to a
// summariser (an OpenAI-compatible completions endpoint) on the client session's executor, and
// the streaming responder that waits for it without blocking the io thread, rewrites B's request
// with its answer and then relays B's request upstream on the same client stream.

#include <boost/asio/any_io_executor.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/proxy/streaming_responder.h"
#include "kvrelay/proxy/upstream_pool.h"
#include "kvrelay/proxy/upstream_relay.h"

namespace kvrelay::proxy {

// Summaries are short (a token budget of ids or text); an answer larger than this is refused.
inline constexpr std::size_t kMaxSummariserResponseBytes = 1 << 20;

struct SummariserCall {
  HttpUrl endpoint;  // a base URL: the request goes to <base_path>/v1/completions
  std::string body;
  std::chrono::milliseconds timeout{30'000};  // connect, write and read together
  std::size_t max_response_bytes = kMaxSummariserResponseBytes;
};

struct SummariserResponse {
  unsigned status = 0;
  std::string body;
};

using SummariserDone = std::function<void(Result<SummariserResponse>)>;

// Sends `call` and calls `done` exactly once on `executor`: the response, or why there is none
// (connect, write or read error, timeout, an answer over max_response_bytes).
void call_summariser(const boost::asio::any_io_executor& executor, SummariserCall call, SummariserDone done);

// What the summary relay does before B's request leaves.
struct SummaryStep {
  SummariserCall call;
  // Given the summariser's answer (or why there is none) and how long it took: B's new request
  // body, or nullopt to forward the body B's request already has (the tokens medium).
  std::function<std::optional<std::string>(Result<SummariserResponse>, std::chrono::steady_clock::duration)> body_for_b;
};

// A responder that runs `step`, then relays `request` (with the body it chose) to `upstream` as
// make_upstream_relay does. The summariser's time is added to the outcome's times: the client
// waited for it.
[[nodiscard]] std::shared_ptr<StreamingResponder> make_summary_relay(
    SummaryStep step, std::shared_ptr<UpstreamPool> pool, HttpUrl upstream, HttpRequest request, bool client_keep_alive,
    std::chrono::milliseconds timeout, std::function<void(const RelayOutcome&)> on_finished,
    std::size_t keep_tail_bytes = 0);

}  // namespace kvrelay::proxy
