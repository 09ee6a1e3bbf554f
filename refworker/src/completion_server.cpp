#include "kvrelay/refworker/completion_server.h"

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <deque>
#include <optional>

namespace kvrelay::refworker {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;

struct CompletionServer::State {
  asio::io_context& io;
  ServerLimits limits;
  ServerContext& context;
  tcp::acceptor acceptor;
  bool accepting = false;

  State(asio::io_context& io_context, ServerLimits server_limits, ServerContext& server_context)
      : io(io_context), limits(server_limits), context(server_context), acceptor(asio::make_strand(io_context)) {}
};

namespace {

// One connection, one request at a time (no pipelining: a completion can run for seconds and
// its answer must come before the next one). A completion's tokens arrive from the model
// thread as posts onto this connection's strand.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket&& socket, std::shared_ptr<CompletionServer::State> server)
      : stream_(std::move(socket)), server_(std::move(server)) {}

  void start() {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_next(); });
  }

 private:
  void read_next() {
    parser_.emplace();
    parser_->header_limit(server_->limits.max_header_bytes);
    parser_->body_limit(server_->limits.max_body_bytes);
    stream_.expires_after(served_ == 0 ? server_->limits.read_timeout : server_->limits.idle_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read(ec);
    stream_.expires_after(server_->limits.read_timeout);
    // curl sends "Expect: 100-continue" for bodies over 1 KiB (long token-id prompts) and waits a
    // second for the go-ahead; answering at once keeps that second out of time to first token.
    if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      asio::async_write(stream_, asio::buffer(kContinue.data(), kContinue.size()),
                        [self = shared_from_this()](beast::error_code write_ec, std::size_t) {
                          if (write_ec) return self->shutdown();
                          self->read_body();
                        });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code read_ec, std::size_t) { self->on_read(read_ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset ||
        ec == asio::error::operation_aborted || ec == beast::error::timeout) {
      return shutdown();
    }
    if (ec) return reject_malformed(ec);
    ++served_;
    request_ = parser_->release();
    auto routed = route_request(server_->context, request_);
    if (auto* response = std::get_if<HttpResponse>(&routed)) return write_response(std::move(*response));
    start_completion(std::move(std::get<PendingCompletion>(routed)));
  }

  void reject_malformed(beast::error_code ec) {
    HttpRequest blank;
    blank.version(11);
    blank.keep_alive(false);
    if (ec == http::error::header_limit) {
      return write_response(json_error(http::status::request_header_fields_too_large, "header_too_large",
                                       fmt::format("request header exceeds {} bytes", server_->limits.max_header_bytes),
                                       blank));
    }
    if (ec == http::error::body_limit) {
      return write_response(json_error(http::status::payload_too_large, "body_too_large",
                                       fmt::format("request body exceeds {} bytes", server_->limits.max_body_bytes),
                                       blank));
    }
    write_response(json_error(http::status::bad_request, "malformed_request",
                              fmt::format("malformed HTTP request: {}", ec.message()), blank));
  }

  void write_response(HttpResponse response) {
    response_ = std::move(response);
    response_.prepare_payload();
    stream_.expires_after(server_->limits.write_timeout);
    http::async_write(stream_, response_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec || !self->response_.keep_alive()) return self->shutdown();
      self->read_next();
    });
  }

  void start_completion(PendingCompletion pending) {
    auto self = shared_from_this();
    const bool stream = pending.request.stream;
    const bool include_usage = pending.request.include_usage_in_stream;
    CompletionJob job;
    job.request = std::move(pending.request);
    const ResponseIdentity identity = std::move(pending.identity);
    if (stream) {
      job.on_token = [self, identity, gone = client_gone_](std::int32_t token) {
        if (gone->load()) return false;
        asio::post(self->stream_.get_executor(), [self, event = sse_event(stream_token_event(identity, token))] {
          self->push_stream(event);
        });
        return true;
      };
      job.on_done = [self, identity, include_usage](Result<CompletionOutcome> outcome) {
        asio::post(self->stream_.get_executor(), [self, identity, include_usage, done = std::move(outcome)] {
          self->finish_stream(identity, done, include_usage);
        });
      };
    } else {
      job.on_done = [self, identity](Result<CompletionOutcome> outcome) {
        asio::post(self->stream_.get_executor(),
                   [self, identity, done = std::move(outcome)] { self->finish_plain(identity, done); });
      };
    }
    if (auto submitted = server_->context.worker->submit(std::move(job)); !submitted) {
      auto response = json_error(status_for(submitted.error()), "overloaded", submitted.error().message, request_);
      response.set(http::field::retry_after, "1");
      return write_response(std::move(response));
    }
    if (stream) start_stream();
  }

  void finish_plain(const ResponseIdentity& identity, const Result<CompletionOutcome>& outcome) {
    if (!outcome) {
      return write_response(json_error(status_for(outcome.error()), "server_error", outcome.error().message, request_));
    }
    HttpResponse response{http::status::ok, request_.version()};
    response.set(http::field::content_type, "application/json");
    response.set(http::field::server, "kvrelay-refworker");
    response.keep_alive(request_.keep_alive());
    response.body() = dump_json(completion_response(identity, outcome.value())) + "\n";
    write_response(std::move(response));
  }

  // SSE over chunked transfer encoding, written by hand: one chunk per event, so each token
  // leaves as soon as it is sampled.
  void start_stream() {
    chunked_ = request_.version() >= 11;
    keep_alive_ = chunked_ && request_.keep_alive();
    std::string header = fmt::format("HTTP/1.{} 200 OK\r\nServer: kvrelay-refworker\r\nContent-Type: text/event-stream\r\n"
                                     "Cache-Control: no-cache\r\n",
                                     chunked_ ? 1 : 0);
    if (chunked_) header += "Transfer-Encoding: chunked\r\n";
    if (!keep_alive_) header += "Connection: close\r\n";
    header += "\r\n";
    enqueue(std::move(header));
  }

  void push_stream(const std::string& event) {
    enqueue(chunked_ ? fmt::format("{:x}\r\n{}\r\n", event.size(), event) : event);
  }

  void finish_stream(const ResponseIdentity& identity, const Result<CompletionOutcome>& outcome, bool include_usage) {
    if (outcome) {
      nlohmann::json final_event = stream_final_event(identity, outcome.value());
      if (!include_usage) final_event.erase("usage");
      push_stream(sse_event(final_event));
    } else if (!client_gone_->load()) {
      push_stream(sse_event({{"error", {{"message", outcome.error().message}, {"type", "server_error"}}}}));
    }
    push_stream("data: [DONE]\n\n");
    if (chunked_) enqueue("0\r\n\r\n");
    stream_finished_ = true;
    if (!writing_) after_stream();
  }

  void enqueue(std::string bytes) {
    if (client_gone_->load()) return;
    out_.push_back(std::move(bytes));
    if (!writing_) write_front();
  }

  void write_front() {
    writing_ = true;
    stream_.expires_after(server_->limits.write_timeout);
    asio::async_write(stream_, asio::buffer(out_.front()), [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->on_stream_written(ec);
    });
  }

  void on_stream_written(beast::error_code ec) {
    writing_ = false;
    if (ec) {
      // The client went away: stop generating for it and drop what is queued.
      client_gone_->store(true);
      out_.clear();
      return shutdown();
    }
    out_.pop_front();
    if (!out_.empty()) return write_front();
    if (stream_finished_) after_stream();
  }

  void after_stream() {
    if (!out_.empty() || writing_ || client_gone_->load()) return;
    stream_finished_ = false;
    if (keep_alive_) return read_next();
    shutdown();
  }

  void shutdown() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::shared_ptr<CompletionServer::State> server_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequest request_;
  HttpResponse response_;
  std::deque<std::string> out_;
  std::shared_ptr<std::atomic<bool>> client_gone_ = std::make_shared<std::atomic<bool>>(false);
  std::uint64_t served_ = 0;
  bool writing_ = false;
  bool chunked_ = true;
  bool keep_alive_ = false;
  bool stream_finished_ = false;
};

void accept_next(const std::shared_ptr<CompletionServer::State>& state) {
  state->acceptor.async_accept(asio::make_strand(state->io), [state](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !state->accepting) return;
    if (ec) {
      spdlog::warn("http: accept failed: {}", ec.message());
    } else {
      std::make_shared<Session>(std::move(socket), state)->start();
    }
    accept_next(state);
  });
}

}  // namespace

CompletionServer::CompletionServer(asio::io_context& io, ServerLimits limits, ServerContext& context)
    : state_(std::make_shared<State>(io, limits, context)) {}

CompletionServer::~CompletionServer() { stop_accepting(); }

Status CompletionServer::listen(const std::string& host, std::uint16_t port) {
  beast::error_code ec;
  const auto ip = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) return fail(ErrorCode::kInvalidArgument, fmt::format("listen address '{}': {}", host, ec.message()));
  const tcp::endpoint endpoint(ip, port);
  auto& acceptor = state_->acceptor;
  if (acceptor.open(endpoint.protocol(), ec); ec) return fail(ErrorCode::kIo, fmt::format("open: {}", ec.message()));
  if (acceptor.set_option(asio::socket_base::reuse_address(true), ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("SO_REUSEADDR: {}", ec.message()));
  }
  if (acceptor.bind(endpoint, ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("bind {}:{}: {}", host, port, ec.message()));
  }
  if (acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) {
    return fail(ErrorCode::kIo, fmt::format("listen {}:{}: {}", host, port, ec.message()));
  }
  state_->accepting = true;
  accept_next(state_);
  return ok();
}

std::uint16_t CompletionServer::port() const {
  beast::error_code ec;
  return state_->acceptor.local_endpoint(ec).port();
}

void CompletionServer::stop_accepting() {
  if (!state_->accepting) return;
  state_->accepting = false;
  asio::post(state_->acceptor.get_executor(), [state = state_] {
    beast::error_code ignored;
    state->acceptor.close(ignored);
  });
}

}  // namespace kvrelay::refworker
