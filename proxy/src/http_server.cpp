#include "kvrelay/proxy/http_server.h"

#include <boost/asio/ip/address.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <deque>
#include <mutex>
#include <optional>
#include <vector>

namespace kvrelay::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;

HttpServerLimits HttpServerLimits::from_policy(const LimitsPolicy& limits) {
  HttpServerLimits result;
  result.max_header_bytes = limits.max_header_bytes;
  result.max_body_bytes = limits.max_body_bytes;
  result.read_timeout = limits.read_timeout;
  result.idle_timeout = limits.idle_timeout;
  result.max_connections = limits.max_connections;
  result.max_queued_responses = limits.max_queued_responses;
  return result;
}

// Named rather than anonymous: HttpServer::State holds these, and GCC warns
// (-Wsubobject-linkage) when a unity build includes this file into another.
namespace http_server_detail {

// What the server needs from a connection when it drains: close it if it sits between requests.
class DrainableSession {
 public:
  virtual ~DrainableSession() = default;
  virtual void close_if_idle() = 0;
};

}  // namespace http_server_detail

using http_server_detail::DrainableSession;

struct HttpServer::State {
  asio::io_context& io;
  HttpServerLimits limits;
  Dispatcher dispatcher;
  tcp::acceptor acceptor;
  std::atomic<std::uint64_t> active{0};
  std::atomic<bool> draining{false};
  bool accepting = false;
  std::mutex sessions_mutex;
  std::vector<std::weak_ptr<DrainableSession>> sessions;

  void track(const std::shared_ptr<DrainableSession>& session) {
    const std::lock_guard lock(sessions_mutex);
    std::erase_if(sessions, [](const auto& weak) { return weak.expired(); });
    sessions.push_back(session);
  }

  State(asio::io_context& context, HttpServerLimits server_limits, Dispatcher request_dispatcher)
      : io(context),
        limits(server_limits),
        dispatcher(std::move(request_dispatcher)),
        acceptor(asio::make_strand(context)) {}
};

namespace {

// One connection. Reads requests with a deadline each, answers each through the handler and
// keeps at most max_queued_responses answers waiting to be written (HTTP pipelining bound).
class HttpSession final : public DrainableSession, public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(tcp::socket&& socket, std::shared_ptr<HttpServer::State> server)
      : stream_(std::move(socket)), server_(std::move(server)) {
    ++server_->active;
  }
  ~HttpSession() override { --server_->active; }
  HttpSession(const HttpSession&) = delete;
  HttpSession& operator=(const HttpSession&) = delete;

  void start() {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_next(); });
  }

  // Draining: a connection waiting for its next request is closed; one mid-request finishes it
  // and is closed after the response (read_next refuses to start another).
  void close_if_idle() override {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      self->closing_ = true;
      const bool mid_request = self->reading_ && self->parser_ && self->parser_->got_some();
      if (!mid_request && self->queue_.empty()) self->shutdown();
    });
  }

  // Over the connection cap: answer 503 once and close, without reading the request.
  void reject_over_capacity() {
    queue_.push_back(
        make_json_error(http::status::service_unavailable, "overloaded", "connection limit reached; retry later"));
    std::get<HttpResponse>(queue_.back()).set(http::field::retry_after, "1");
    closing_ = true;
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->write_front(); });
  }

 private:
  void read_next() {
    if (server_->draining.load()) closing_ = true;
    if (closing_ || reading_) {
      if (closing_ && !reading_ && queue_.empty()) shutdown();
      return;
    }
    parser_.emplace();
    parser_->header_limit(server_->limits.max_header_bytes);
    parser_->body_limit(server_->limits.max_body_bytes);
    // A fresh connection or a kept-alive one waits up to idle_timeout for the next request to
    // begin; the request itself must then arrive within read_timeout (set in on_header).
    stream_.expires_after(requests_served_ == 0 ? server_->limits.read_timeout : server_->limits.idle_timeout);
    reading_ = true;
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read(ec);
    // A small request's body usually came in the segment that brought its header: parse it from
    // the buffer without starting another read (and arming its deadline) for bytes already here.
    if (parse_buffered_body(ec) || ec) return on_read(ec);
    stream_.expires_after(server_->limits.read_timeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code read_ec, std::size_t) { self->on_read(read_ec); });
  }

  // True when the request is complete from what the buffer holds.
  bool parse_buffered_body(beast::error_code& ec) {
    while (!parser_->is_done() && buffer_.size() > 0) {
      const std::size_t consumed = parser_->put(buffer_.data(), ec);
      buffer_.consume(consumed);
      if (ec == http::error::need_more) ec = {};
      if (ec || consumed == 0) break;
    }
    return !ec && parser_->is_done();
  }

  void on_read(beast::error_code ec) {
    reading_ = false;
    if (ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset ||
        ec == asio::error::operation_aborted) {
      return close_when_drained();
    }
    if (ec == beast::error::timeout) {
      spdlog::debug("http: closing connection: read deadline passed");
      return close_when_drained();
    }
    if (ec) return fail_request(ec);

    ++requests_served_;
    HttpRequest request = parser_->release();
    const unsigned version = request.version();
    const bool client_keep_alive = request.keep_alive();
    Reply reply = server_->dispatcher(std::move(request));
    if (auto* response = std::get_if<HttpResponse>(&reply)) {
      response->version(version);
      response->keep_alive(client_keep_alive && response->keep_alive() && !server_->draining.load());
      response->prepare_payload();
    } else {
      streaming_keep_alive_ = client_keep_alive;
    }
    queue_.push_back(std::move(reply));
    if (queue_.size() == 1) write_front();
    // A streamed reply owns the connection until it finishes: no pipelined reads meanwhile.
    if (queue_.size() < server_->limits.max_queued_responses && std::holds_alternative<HttpResponse>(queue_.back())) {
      read_next();
    }
  }

  void fail_request(beast::error_code ec) {
    HttpResponse response;
    if (ec == http::error::header_limit) {
      response = make_json_error(http::status::request_header_fields_too_large, "header_too_large",
                                 fmt::format("request header exceeds {} bytes", server_->limits.max_header_bytes));
    } else if (ec == http::error::body_limit) {
      response = make_json_error(http::status::payload_too_large, "body_too_large",
                                 fmt::format("request body exceeds {} bytes", server_->limits.max_body_bytes));
    } else {
      response = make_json_error(http::status::bad_request, "malformed_request",
                                 fmt::format("malformed HTTP request: {}", ec.message()));
    }
    response.prepare_payload();
    closing_ = true;
    queue_.push_back(std::move(response));
    if (queue_.size() == 1) write_front();
  }

  void write_front() {
    if (auto* response = std::get_if<HttpResponse>(&queue_.front())) {
      stream_.expires_after(server_->limits.read_timeout);
      http::async_write(stream_, *response, [self = shared_from_this()](beast::error_code ec, std::size_t) {
        self->on_written(!ec, !ec && std::get<HttpResponse>(self->queue_.front()).keep_alive());
      });
      return;
    }
    auto responder = std::get<std::shared_ptr<StreamingResponder>>(queue_.front());
    responder->start(stream_, [self = shared_from_this()](bool keep_alive) {
      // The responder may finish on another executor; continue on the session's.
      asio::dispatch(self->stream_.get_executor(), [self, keep_alive] {
        self->on_written(true, keep_alive && self->streaming_keep_alive_ && !self->server_->draining.load());
      });
    });
  }

  void on_written(bool succeeded, bool keep_alive) {
    if (!succeeded) return shutdown();
    const bool was_full = queue_.size() >= server_->limits.max_queued_responses;
    const bool was_streaming = !std::holds_alternative<HttpResponse>(queue_.front());
    queue_.pop_front();
    if (!keep_alive) closing_ = true;
    if (!queue_.empty()) return write_front();
    if (closing_) return shutdown();
    if (was_full || was_streaming || !reading_) read_next();
  }

  void close_when_drained() {
    closing_ = true;
    if (queue_.empty()) shutdown();
  }

  void shutdown() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::shared_ptr<HttpServer::State> server_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<Reply> queue_;
  bool streaming_keep_alive_ = true;
  std::uint64_t requests_served_ = 0;
  bool reading_ = false;
  bool closing_ = false;
};

void accept_next(const std::shared_ptr<HttpServer::State>& state) {
  state->acceptor.async_accept(asio::make_strand(state->io), [state](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !state->accepting) return;
    if (ec) {
      spdlog::warn("http: accept failed: {}", ec.message());
    } else {
      // Responses go out in several writes (headers, streamed chunks): Nagle would hold each
      // small write for the peer's delayed ACK.
      beast::error_code option_ec;
      socket.set_option(tcp::no_delay(true), option_ec);
      auto session = std::make_shared<HttpSession>(std::move(socket), state);
      if (state->active.load() > state->limits.max_connections) {
        session->reject_over_capacity();
      } else {
        state->track(session);
        session->start();
      }
    }
    accept_next(state);
  });
}

}  // namespace

HttpServer::HttpServer(asio::io_context& io, HttpServerLimits limits, Dispatcher dispatcher)
    : state_(std::make_shared<State>(io, limits, std::move(dispatcher))) {}

HttpServer::~HttpServer() {
  stop_accepting();
}

Status HttpServer::listen(const HostPort& address) {
  beast::error_code ec;
  const auto ip = asio::ip::make_address(address.host == "localhost" ? "127.0.0.1" : address.host, ec);
  if (ec) return fail(ErrorCode::kInvalidArgument, fmt::format("listen address '{}': {}", address.host, ec.message()));
  const tcp::endpoint endpoint(ip, address.port);
  auto& acceptor = state_->acceptor;
  if (acceptor.open(endpoint.protocol(), ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("open {}: {}", address.to_string(), ec.message()));
  }
  if (acceptor.set_option(asio::socket_base::reuse_address(true), ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("SO_REUSEADDR {}: {}", address.to_string(), ec.message()));
  }
  if (acceptor.bind(endpoint, ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("bind {}: {}", address.to_string(), ec.message()));
  }
  if (acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("listen {}: {}", address.to_string(), ec.message()));
  }
  state_->accepting = true;
  accept_next(state_);
  return ok();
}

tcp::endpoint HttpServer::local_endpoint() const {
  beast::error_code ec;
  return state_->acceptor.local_endpoint(ec);
}

void HttpServer::drain() {
  stop_accepting();
  state_->draining = true;
  std::vector<std::shared_ptr<DrainableSession>> sessions;
  {
    const std::lock_guard lock(state_->sessions_mutex);
    for (const auto& weak : state_->sessions) {
      if (auto session = weak.lock()) sessions.push_back(std::move(session));
    }
  }
  for (const auto& session : sessions)
    session->close_if_idle();
}

void HttpServer::stop_accepting() {
  if (!state_->accepting) return;
  state_->accepting = false;
  asio::post(state_->acceptor.get_executor(), [state = state_] {
    beast::error_code ignored;
    state->acceptor.close(ignored);
  });
}

std::uint64_t HttpServer::active_connections() const {
  return state_->active.load();
}

}  // namespace kvrelay::proxy
