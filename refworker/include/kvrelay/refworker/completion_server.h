#pragma once

// The worker's OpenAI-compatible HTTP face (Boost.Beast): routing is a pure function from
// request to either a finished response or a completion to run; sessions own the sockets,
// deadlines, parser limits and the SSE stream of a running completion.

#include <boost/asio/io_context.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/completion_api.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/model_worker.h"
#include "kvrelay/refworker/worker_metrics.h"

namespace kvrelay::refworker {

namespace http = boost::beast::http;
using HttpRequest = http::request<http::string_body>;
using HttpResponse = http::response<http::string_body>;

struct ServerLimits {
  std::uint32_t max_header_bytes = 16 * 1024;
  std::uint64_t max_body_bytes = 64ULL * 1024 * 1024;  // token-id prompts of a long context
  std::chrono::milliseconds read_timeout{30'000};
  std::chrono::milliseconds idle_timeout{60'000};
  std::chrono::milliseconds write_timeout{30'000};
};

// Everything the routes need; owned by the serve command, outlives the server.
struct ServerContext {
  const Model* model = nullptr;
  ModelWorker* worker = nullptr;
  WorkerMetrics* metrics = nullptr;
  std::string model_name;
  CompletionLimits limits;
  std::atomic<std::uint64_t> next_request{1};
};

// A completion to run: the parsed request and the identity its responses carry.
struct PendingCompletion {
  CompletionRequest request;
  ResponseIdentity identity;
};

using RouteResult = std::variant<HttpResponse, PendingCompletion>;

// GET /healthz, GET /v1/models, GET /metrics answer directly; a valid POST /v1/completions
// becomes a PendingCompletion; anything else is an OpenAI-style JSON error.
[[nodiscard]] RouteResult route_request(ServerContext& context, const HttpRequest& request);

[[nodiscard]] HttpResponse json_error(http::status status, std::string_view type, std::string_view message,
                                      const HttpRequest& request);
// HTTP status for a failed completion: 503 when overloaded or shutting down, 400 for bad input.
[[nodiscard]] http::status status_for(const Error& error);

class CompletionServer {
 public:
  CompletionServer(boost::asio::io_context& io, ServerLimits limits, ServerContext& context);
  ~CompletionServer();
  CompletionServer(const CompletionServer&) = delete;
  CompletionServer& operator=(const CompletionServer&) = delete;

  [[nodiscard]] Status listen(const std::string& host, std::uint16_t port);
  [[nodiscard]] std::uint16_t port() const;
  void stop_accepting();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kvrelay::refworker
